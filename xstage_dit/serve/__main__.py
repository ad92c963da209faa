r"""Serve a pipeline over HTTP from one torchrun job (docs/serving.md):

    torchrun --nproc_per_node 2 -m xstage_dit.serve                      # the tiny random Flux, CPU or GPU
    torchrun --nproc_per_node 8 -m xstage_dit.serve --model black-forest-labs/FLUX.1-dev --port 8000

Every rank loads and enables the pipeline once; rank 0 answers HTTP on --host:--port and tells every rank which
requests to run."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING

from ..launcher import launched
from ..testing.catalog import CONFIGS
from . import cost, loading, media
from .intake import KEYS_FILE_ENV, key_problem, read_keys
from .schema import Limits, ModelCard, ServeOptions

if TYPE_CHECKING:
    from .ranks import SideChannel

# torch, diffusers and the service's modules that import them (seconds) are imported by the functions that run the
# job, once its arguments are checked: --help and a bad argument answer at once

logger = logging.getLogger(__name__)

STARTUP_S = 60.0  # how long rank 0 waits for its HTTP server to listen


def parse_args(argv: list[str] | None, prog: str = "xstage_dit.serve") -> argparse.Namespace:
    parser = loading.JobParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    loading.add_pipeline_arguments(parser)
    defaults, limits = ServeOptions(), Limits()
    parser.add_argument("--host", default=defaults.host)
    parser.add_argument("--port", type=int, default=defaults.port)
    parser.add_argument("--queue-bound", type=int, default=defaults.queue_bound,
                        help="requests admitted and not answered (waiting or running); one more answers 429 "
                             "with Retry-After")
    parser.add_argument("--max-batch", type=int, default=defaults.max_batch,
                        help="outputs of compatible requests (same size, steps, guidance) run in one pipeline call")
    parser.add_argument("--timeout-s", type=float, default=defaults.timeout_s,
                        help="bound on one denoising step (on a whole call, for a pipeline without step callbacks) "
                             "and on every wait between ranks (enable's timeout_s): past it the job ends")
    parser.add_argument("--max-n", type=int, default=limits.max_n, help="outputs one request may ask for")
    parser.add_argument("--max-steps", type=int, default=limits.max_steps)
    parser.add_argument("--max-pixels", type=int, default=limits.max_pixels, help="width x height at most")
    parser.add_argument("--max-frames", type=int, default=limits.max_frames)
    parser.add_argument("--max-body-mb", type=float, default=defaults.max_body_bytes / 2**20,
                        help="a request's body at most, its images included, in MiB; more answers 413")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="every endpoint but /health needs `Authorization: Bearer KEY` with one of these keys "
                             f"(repeatable; or ${KEYS_FILE_ENV} names a file of keys, one a line)")
    parser.add_argument("--open-metrics", action="store_true",
                        help="with keys, /metrics needs none (for a Prometheus scraper)")
    parser.add_argument("--max-timeout-s", type=float, default=limits.max_timeout_s,
                        help="the longest deadline (`timeout_s`) a request may ask for, and the deadline of one "
                             "that asks for none: past it the request answers 504 and its call stops")
    args = parser.parse_args(argv)
    loading.check_enable_knobs(parser, args)
    for name in ("queue_bound", "max_batch", "max_n", "max_steps", "max_pixels", "max_frames"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.timeout_s <= 0 or args.max_timeout_s <= 0:
        parser.error("--timeout-s and --max-timeout-s must be positive")
    if not args.max_body_mb > 0:
        parser.error("--max-body-mb must be positive")
    if os.environ.get(KEYS_FILE_ENV) and launched().is_main:  # the main rank alone answers HTTP
        try:
            args.api_key += read_keys(os.environ[KEYS_FILE_ENV])
        except OSError as error:
            parser.error(f"${KEYS_FILE_ENV}: {error}")
    for key in args.api_key:
        if (problem := key_problem(key)) is not None:
            parser.error(f"--api-key: {problem}")
    return args


def model_card(loaded: loading.LoadedPipeline, model_id: str) -> ModelCard:
    """What the served pipeline takes: sizes in multiples of its VAE's downsampling times its 2 x 2 patches, its
    input images, and the request fields it has no argument for."""
    from ..testing import zoo

    pipe = loaded.pipe
    multiple = loading.size_multiple(pipe)
    entry = zoo.ZOO[loaded.config] if loaded.config is not None else None
    height, width = (entry.height, entry.width) if entry else (None, None)
    arguments = {"negative_prompt": "negative_prompt", "num_inference_steps": "num_inference_steps",
                 "num_frames": "num_frames",
                 "guidance_scale": loaded.family.guidance_kwarg if loaded.family else "guidance_scale"}
    return ModelCard(id=model_id, video=loaded.is_video, image=loading.image_input(type(pipe)),
                     text_encoder=loaded.config is None, size_multiple=multiple,
                     default_height=height, default_width=width, fps=loaded.fps,
                     max_images=loading.max_input_images(type(pipe)), mask=loading.inpaints(type(pipe)),
                     ignored=frozenset(field for field, kwarg in arguments.items() if not loaded.takes(kwarg)),
                     scale=cost.model_scale(pipe, multiple, height, width, entry.num_frames if entry else None,
                                            loading.ZOO_STEPS if entry else None, loaded.is_video))


def exit_now(code: int) -> None:
    """End the process with `code` once its output is flushed, skipping the interpreter's teardown of torch and
    diffusers (seconds, on a busy host), so that a drained job is gone as soon as it is done."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None, prog: str = "xstage_dit.serve") -> int:
    args = parse_args(argv, prog)
    if not args.model:  # a zoo config makes videos or not, known before it loads
        _check_video_writer(CONFIGS[args.config].video, args.config)
    from ..api import enable, is_main_process
    from ..runtime.distributed import local_device
    from .ranks import CallStatus, SideChannel
    from .service import follow

    logging.basicConfig(level=logging.INFO if is_main_process() else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loading.quiet_libraries()
    if is_main_process():
        _check_address(args.host, args.port)
    if args.model:
        _check_inputs(args.model)
    device = local_device()
    family = loading.family_of(args.model, args.config)
    loaded = loading.load_pipeline(args.model, args.config, family, device, loading.default_dtype(args, device))
    if args.model:
        _check_video_writer(loaded.is_video, args.model)
    loaded.pipe.set_progress_bar_config(disable=True)  # progress is the service's (SSE, metrics)
    enable(loaded.pipe, timeout_s=args.timeout_s, **loading.enable_knobs(args))
    channel = SideChannel(args.timeout_s)
    channel.statuses(CallStatus(channel.rank, None))  # every rank has loaded and enabled the pipeline
    # what the service returns, the process exits with at once (exit_now): a drained rank has nothing left to
    # tear down, and a rank out of step must run no collective again
    if channel.rank == 0:
        return _serve(loaded, args, channel)
    return follow(loaded, channel, args.timeout_s)


def _check_video_writer(is_video: bool, name: str) -> None:
    """A video model's answers are MP4s: the packages that write them are installed."""
    if is_video and not media.can_write_mp4():
        raise SystemExit(f"xstage_dit.serve: {name} makes videos, answered as MP4s: that needs imageio, "
                         f"imageio-ffmpeg and PyAV (pip install 'xstage_dit[video]')")


def _check_inputs(model: str) -> None:
    """Before loading a checkpoint: its pipeline needs no input that a request cannot give."""
    pipeline_cls = loading.pipeline_class(model)
    uncarried = loading.uncarried_inputs(pipeline_cls) if pipeline_cls is not None else []
    if uncarried:
        raise SystemExit(f"xstage_dit.serve: {pipeline_cls.__name__} needs {', '.join(uncarried)}, which the "
                         f"service's requests do not carry (their inputs are `image` and `mask`)")


def _check_address(host: str, port: int) -> None:
    """Before minutes of loading: the address is free to listen on (uvicorn binds it again once every rank is
    ready)."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as error:
        raise SystemExit(f"xstage_dit.serve: cannot listen on {host}:{port}: {error}") from error


def _serve(loaded: loading.LoadedPipeline, args: argparse.Namespace, channel: SideChannel) -> int:
    import uvicorn

    from .app import create_app
    from .errors import uvicorn_protocol
    from .metrics import ServiceMetrics
    from .service import Service

    options = ServeOptions(host=args.host, port=args.port, queue_bound=args.queue_bound, max_batch=args.max_batch,
                           timeout_s=args.timeout_s,
                           limits=Limits(args.max_n, args.max_steps, args.max_pixels, args.max_frames,
                                         args.max_timeout_s),
                           enable={**loading.enable_knobs(args), "dtype": str(loaded.dtype)},
                           max_body_bytes=int(args.max_body_mb * 2**20), api_keys=tuple(args.api_key),
                           open_metrics=args.open_metrics)
    service = Service(loaded, model_card(loaded, args.model or args.config), options, channel, ServiceMetrics())
    service.warm_up()
    server = uvicorn.Server(uvicorn.Config(create_app(service), host=args.host, port=args.port, log_level="warning",
                                           lifespan="off", timeout_graceful_shutdown=5, http=uvicorn_protocol()))
    http = threading.Thread(target=server.run, name="xstage-serve-http", daemon=True)
    http.start()
    deadline = time.monotonic() + STARTUP_S
    while not server.started:
        if not http.is_alive() or time.monotonic() > deadline:
            raise SystemExit(f"xstage_dit.serve: the HTTP server did not start on {args.host}:{args.port}")
        time.sleep(0.05)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, service.drain)
    logger.info("serving %s on http://%s:%d (%d rank(s))", service.card.id, args.host, args.port, channel.world)
    code = service.run()
    server.should_exit = True
    http.join(timeout=10)
    return code


if __name__ == "__main__":
    exit_now(main())
