"""What the GPU tests share: the tiny pipelines' sizes on a GPU, a seeded bf16 call, and the worker that checks a
pipeline enabled on ranks sharing one GPU against the stock one."""
from __future__ import annotations

import torch
import torch.distributed as dist

import xstage_dit
from xstage_dit.testing import zoo
from dist_harness import share_one_gpu
from numerics import relative_error


PIPELINE_TOLERANCE = 3e-2


def generate(pipe, name: str, size: dict, batch: int = 1) -> torch.Tensor:
    kwargs = zoo.call_kwargs(name, **size, steps=2, guidance=3.0)
    embeddings = zoo.text_embeddings(name, batch, seed=1, device="cuda", dtype=torch.bfloat16)
    return pipe(**kwargs, **embeddings, output_type="latent", generator=torch.Generator().manual_seed(5),
                return_dict=False)[0]


SIZES = {"tiny-flux": {"height": 20, "width": 28, "num_frames": 1},
         "tiny-flux-d64": {"height": 20, "width": 28, "num_frames": 1},
         "tiny-wan": {"height": 16, "width": 112, "num_frames": 17},
         "tiny-wan-d64": {"height": 16, "width": 112, "num_frames": 17},
         "tiny-hunyuan-video": {"height": 16, "width": 112, "num_frames": 17},
         "tiny-nucleusmoe": {"height": 40, "width": 56, "num_frames": 1},
         "tiny-flux2": {"height": 20, "width": 28, "num_frames": 1},
         "tiny-nucleusmoe-d64": {"height": 40, "width": 56, "num_frames": 1},
         "tiny-zimage": {"height": 20, "width": 28, "num_frames": 1},
         "tiny-chroma": {"height": 20, "width": 28, "num_frames": 1},
         "tiny-zimage-d64": {"height": 20, "width": 28, "num_frames": 1},
         "tiny-ltx2": {"height": 32, "width": 32, "num_frames": 9},
         "tiny-hunyuan-video15": {"height": 16, "width": 112, "num_frames": 17},
         "tiny-wan2.2-ti2v": {"height": 32, "width": 224, "num_frames": 17},
         "tiny-wan-vace": {"height": 16, "width": 112, "num_frames": 17},
         "tiny-qwenimage-edit-2511": {"height": 64, "width": 96, "num_frames": 1},
         "tiny-qwenimage21": {"height": 64, "width": 160, "num_frames": 1},
         "tiny-flux-multi-controlnet": {"height": 20, "width": 28, "num_frames": 1},
         "tiny-flux-multi-controlnet-d64": {"height": 20, "width": 28, "num_frames": 1},
         "tiny-flux2-klein-kv": {"height": 20, "width": 28, "num_frames": 1},
         "tiny-qwenimage-controlnet": {"height": 40, "width": 56, "num_frames": 1},
         "tiny-zimage-controlnet": {"height": 20, "width": 28, "num_frames": 1}}


def same_gpu_worker(name: str, backend: str, expect_choice: str | None = None,
                     expert_parallel: bool | None = None, degrees: dict | None = None,
                     fp8: tuple[str, ...] | str | None = None, tolerance: float = PIPELINE_TOLERANCE) -> None:
    """`degrees`: more of enable's knobs (the degrees); `fp8`: enable's fp8 knob; `tolerance`: of the relative
    error to the stock pipeline."""
    # NCCL refuses two ranks on one GPU; gloo moves CUDA tensors through the host, enough for correctness;
    # symmetric memory's CUDA backend maps the ranks' buffers into each other on the shared GPU
    share_one_gpu()
    dist.init_process_group("gloo")
    choices = _record_auto_choices()
    stores = _count_expert_stores()
    pipe = zoo.build_pipeline(name, device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    stock = generate(pipe, name, SIZES[name], batch=2)
    xstage_dit.enable(pipe, backend=backend, timeout_s=60, expert_parallel=expert_parallel,
                      fp8=fp8, **(degrees or {}))
    error = relative_error(generate(pipe, name, SIZES[name], batch=2), stock)
    world = dist.get_world_size()
    assert error < tolerance, f"{name}, {backend}, {world} ranks on one GPU: relative error {error:.2e}"
    if expect_choice:
        assert choices and all(f"-> {expect_choice} " in c for c in choices), choices
    if expert_parallel:  # over the fused backend's fabric: every MoE layer call ran the X-Stage stores
        assert stores, "the expert stores did not run"


def _count_expert_stores() -> list[int]:
    """One entry per MoE layer call that ran the X-Stage stores."""
    from xstage_dit.sp.moe import layer as expert_layer

    calls: list[int] = []
    original = expert_layer.expert_exchange

    def counted(*args):
        calls.append(1)
        return original(*args)

    expert_layer.expert_exchange = counted
    return calls


def _record_auto_choices() -> list[str]:
    """The messages in which backend="auto" announces its choices."""
    import logging

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "auto:" in record.getMessage():
                seen.append(record.getMessage())

    log = logging.getLogger("xstage_dit")
    log.setLevel(logging.INFO)
    log.addHandler(Keep())
    return seen
