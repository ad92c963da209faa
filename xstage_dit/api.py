"""enable / disable / is_main_process: the public entry points."""
from __future__ import annotations

import contextlib
import functools
import math
import numbers
from dataclasses import dataclass, fields
from typing import Any, Iterator

import torch
import torch.distributed as dist
from diffusers import ModelMixin
from torch import nn

from . import patches
from .patches.vaes import supported_vaes, vae_rule_for
from .cfg.split import CfgSplit, PairedCalls
from .cfg.plan import PAIRS
from .config import XStageConfig
from .fusions.gelu import epilogue_gelus
from .logging_utils import logger, warn_once
from .hooks.pipeline_call import is_wrapped, unwrap_pipeline_call, wrap_pipeline_call
from .runtime import ParallelGroups, build_groups, ensure_process_group, world_from_env
from .runtime.agreement import Fingerprint, call_fingerprint, check_agreement, weights_checksum
from .runtime.cuda_graphs import CrossRankWork, GraphedForward, GraphUse, repeated_blocks
from .runtime.distributed import local_device, world_group
from .sp.attention.ulysses import UlyssesAttention
from .sp.attention.backends import available_backends, needs_fabric, resolve_backend
from .sp.cache_hooks import stateful_hooks
from .sp.moe.modes import ExpertModes
from .sp.plan import AppliedPlan
from .sp.sharding import SequenceShard
from .vae.decode import ParallelDecode

_STATE_ATTR = "_xstage_dit_applied"
_PROGRESS_ATTR = "_xstage_dit_progress_bar_config"
_TRANSFORMER_ATTRS = ("transformer", "transformer_2")


def _transformers_of(target: Any) -> list[nn.Module]:
    if isinstance(target, ModelMixin):
        return [target]
    found = [getattr(target, name, None) for name in _TRANSFORMER_ATTRS]
    found = [model for model in found if model is not None]
    if not found:
        raise TypeError(
            f"xstage_dit.enable expects a diffusers pipeline with a `transformer` or a diffusers transformer model, "
            f"got {type(target).__name__}"
        )
    return found


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_types(ulysses_degree: Any, cfg_degree: Any, backend: Any, timeout_s: Any, fuse_rope: Any, fuse_mlp: Any,
                 check_inputs: Any, cuda_graphs: Any, parallel_vae: Any, expert_parallel: Any) -> None:
    """Each argument's type and range, named in the error with the value given."""
    if ulysses_degree is not None and not (_is_int(ulysses_degree) and ulysses_degree >= 1):
        raise TypeError(f"ulysses_degree must be None or an int >= 1, got {ulysses_degree!r}")
    if not (_is_int(cfg_degree) and cfg_degree in (1, 2)):
        raise ValueError(f"cfg_degree must be 1 or 2 (guidance has two branches), got {cfg_degree!r}")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a name from {available_backends()}, got {backend!r}")
    if not (isinstance(timeout_s, numbers.Real) and not isinstance(timeout_s, bool)
            and 0 < timeout_s < math.inf):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    for name, value in (("fuse_rope", fuse_rope), ("fuse_mlp", fuse_mlp), ("check_inputs", check_inputs)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
        raise TypeError(f"cuda_graphs must be None (on where there is a GPU), True or False, got {cuda_graphs!r}")
    if parallel_vae is not None and not isinstance(parallel_vae, bool):
        raise TypeError(f"parallel_vae must be None (on where supported), True or False, got {parallel_vae!r}")
    if expert_parallel is not None and not isinstance(expert_parallel, bool):
        raise TypeError(f"expert_parallel must be None (chosen per layer call), True or False, "
                        f"got {expert_parallel!r}")


def _ulysses_degree(world_size: int, ulysses_degree: int | None, cfg_degree: int) -> int:
    """The Ulysses degree the job runs: the one given, checked against the world, else world / cfg_degree."""
    if world_size % cfg_degree:
        raise ValueError(f"cfg_degree={cfg_degree} does not divide the world size {world_size}")
    fits = world_size // cfg_degree
    if ulysses_degree is not None and ulysses_degree != fits:
        with_cfg = f" with cfg_degree={cfg_degree}" if cfg_degree != 1 else ""
        raise ValueError(f"ulysses_degree={ulysses_degree} does not fit the world size {world_size}{with_cfg}: "
                         f"the ranks are split into cfg_degree x ulysses_degree, so it must be {fits}")
    return fits


def _check_heads(model: nn.Module, heads: int, degree: int, given: bool, world_size: int) -> None:
    """Heads must split over the Ulysses degree; otherwise say which splits of this world would work."""
    if heads % degree == 0:
        return
    asked = f"ulysses_degree={degree}" if given else f"splitting them over all {world_size} ranks"
    working = [f"cfg_degree={c} (Ulysses over {world_size // c} ranks)" for c in (1, 2)
               if world_size % c == 0 and heads % (world_size // c) == 0]
    hint = (f"in a world of {world_size} ranks these work: {', '.join(working)}" if working else
            f"no split of {world_size} ranks works: the Ulysses degree (the world size, or half of it with "
            f"cfg_degree=2) must divide {heads}")
    raise ValueError(f"{type(model).__name__} has {heads} attention heads, which {asked} cannot split; {hint}")


def _cuda_graphs(asked: bool | None, device: torch.device) -> bool:
    """Graphs by default where there is a GPU; asked for without one, an error."""
    if asked and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a GPU; this rank runs on {device}")
    return device.type == "cuda" if asked is None else asked


def _parallel_vae(asked: bool | None, vae: nn.Module | None) -> bool:
    """The decode split by rows by default where the pipeline's VAE is supported; asked for where it is not, an
    error; otherwise the decode stays whole on every rank, said once."""
    supported = vae is not None and vae_rule_for(vae) is not None
    if asked and not supported:
        what = "this pipeline has no VAE" if vae is None else f"{type(vae).__name__} has no parallel decode"
        raise ValueError(f"parallel_vae=True: {what}; the decode can be split for "
                         f"{', '.join(supported_vaes())}")
    if asked is None and vae is not None and not supported and world_from_env()[0] > 1:
        warn_once(f"xstage_dit: {type(vae).__name__} has no parallel decode (supported: "
                  f"{', '.join(supported_vaes())}): every rank decodes the whole latent")
    return supported if asked is None else asked


def _expert_parallel(asked: bool | None, models: list[nn.Module], degree: int) -> bool | None:
    """Experts sharded over the Ulysses group where asked for: the models must have MoE layers whose plan can
    shard them, with an expert count the degree divides. None leaves the choice per layer call to the planner
    (sp/moe/modes.py), with every expert kept on every rank."""
    if not asked:
        return asked
    if degree == 1:
        raise ValueError("expert_parallel=True shards the experts over the Ulysses group: it needs a Ulysses "
                         "degree above 1")
    for model in models:
        plan = patches.plan_for(model)
        experts = plan.num_experts(model) if plan.num_experts is not None else 0
        if not experts:
            raise ValueError(f"expert_parallel=True: {type(model).__name__} has no mixture-of-experts layers that "
                             f"xstage_dit can shard (expert parallel runs for NucleusMoE-Image and HiDream)")
        if experts % degree:
            works = [n for n in range(2, experts + 1) if experts % n == 0]
            raise ValueError(f"expert_parallel=True: {experts} experts do not split over a Ulysses degree of "
                             f"{degree}; degrees that divide them: {works}")
    return True


def _resolve_config(
    pipe: Any, models: list[nn.Module], ulysses_degree: Any, cfg_degree: Any, backend: Any, timeout_s: Any,
    fuse_rope: Any, fuse_mlp: Any, check_inputs: Any, cuda_graphs: Any, parallel_vae: Any, expert_parallel: Any,
) -> XStageConfig:
    """Check every argument against the job and the models, before any collective."""
    _check_types(ulysses_degree, cfg_degree, backend, timeout_s, fuse_rope, fuse_mlp, check_inputs, cuda_graphs,
                 parallel_vae, expert_parallel)
    world_size, _ = world_from_env()
    degree = _ulysses_degree(world_size, ulysses_degree, cfg_degree)
    for model in models:
        plan = patches.plan_for(model)
        if plan.check_model is not None:
            plan.check_model(model)
        _check_heads(model, plan.num_heads(model), degree, ulysses_degree is not None, world_size)
    resolve_backend(backend, local_device())
    return XStageConfig(ulysses_degree=degree, cfg_degree=int(cfg_degree), backend=backend,
                        timeout_s=float(timeout_s), fuse_rope=fuse_rope, fuse_mlp=fuse_mlp, check_inputs=check_inputs,
                        cuda_graphs=_cuda_graphs(cuda_graphs, local_device()),
                        parallel_vae=_parallel_vae(parallel_vae, getattr(pipe, "vae", None)),
                        expert_parallel=_expert_parallel(expert_parallel, models, degree))


def _fingerprint(models: list[nn.Module], config: XStageConfig) -> Fingerprint:
    """What every rank's `enable` must agree on: the resolved arguments, the models' classes and weights."""
    fingerprint = Fingerprint()
    for name in ("ulysses_degree", "cfg_degree", "backend", "timeout_s", "fuse_rope", "fuse_mlp", "cuda_graphs",
                 "parallel_vae", "expert_parallel"):
        fingerprint.add(name, getattr(config, name))
    for model in models:
        fingerprint.add("model class", type(model).__name__)
        fingerprint.add(f"{type(model).__name__} weights", weights_checksum(model))
    return fingerprint


def _move_to_rank_device(target: Any, models: list[nn.Module], device: torch.device) -> None:
    """Under torchrun every rank must own its GPU; a pipeline put on "cuda" lands on cuda:0 on every rank."""
    current = next(models[0].parameters()).device
    if current.type == "cuda" and current != device:
        logger.info("moving the pipeline from %s to this rank's %s", current, device)
        target.to(device)


def enable(
    pipe: Any,
    *,
    ulysses_degree: int | None = None,
    cfg_degree: int = 1,
    backend: str = "auto",
    timeout_s: float = 600.0,
    fuse_rope: bool = True,
    fuse_mlp: bool = True,
    check_inputs: bool = True,
    cuda_graphs: bool | None = None,
    parallel_vae: bool | None = None,
    expert_parallel: bool | None = None,
) -> Any:
    """Run `pipe`'s transformer(s) with Ulysses sequence parallelism across the job's ranks; returns `pipe`.

    `pipe` is a diffusers pipeline (its `transformer` and `transformer_2` are patched) or a bare diffusers
    transformer. Under torchrun / accelerate the default process group is started if the caller has not;
    in a single process the model runs unsplit with xstage_dit's attention. Every rank must make the same
    calls with the same inputs; every rank gets the whole result. `fuse_rope=False` keeps diffusers' own
    rotary-embedding code in the patched attention (our one-pass RoPE kernel runs it by default on a GPU; in
    Flux and Chroma one kernel pass also takes the q/k RMSNorms before it). `fuse_mlp=False` keeps diffusers'
    feed-forward code (by default a tanh-GELU runs in its GEMM's epilogue on a GPU, and FLUX.1's and Chroma's
    single-stream blocks project their attention and MLP outputs without joining them); both fusions change
    rounding slightly.
    `check_inputs=False` skips the small collectives in which the ranks check that they got the same
    arguments and models (weights included) at `enable`, and the same arguments at every pipeline call.
    `cuda_graphs` (default: on where there is a GPU) captures each transformer's forward per input signature
    in a CUDA graph and replays it (runtime/cuda_graphs.py); a forward that cannot be captured runs eagerly,
    with one warning saying why, and its repeated blocks are captured one by one instead. `parallel_vae`
    (default: on where the pipeline's VAE is supported) splits the VAE decode by rows across all the job's
    ranks (vae/); every rank still returns the whole image or video.
    `expert_parallel=True` shards a mixture of experts over the Ulysses group (each rank keeps E/N experts on its
    device and the others on the host until `disable`); `False` keeps every expert on every rank, each running
    the experts on its own tokens; the default (None) keeps every expert on every rank and runs each MoE layer
    call in the mode the Burst-Gap planner predicts fastest (sp/moe/modes.py).

    A pipeline that shares enabled transformers (e.g. one made by `from_pipe`) is enabled with the same
    arguments: its calls then take part in the CFG split too; other arguments are refused."""
    models = _transformers_of(pipe)
    enabled = [getattr(model, _STATE_ATTR, None) for model in models]
    if any(state is not None and id(pipe) in state.pipelines for state in enabled) or (
            isinstance(pipe, ModelMixin) and enabled[0] is not None):
        raise RuntimeError(f"xstage_dit.enable was already called on this {type(models[0]).__name__}")
    config = _resolve_config(pipe, models, ulysses_degree, cfg_degree, backend, timeout_s, fuse_rope, fuse_mlp,
                             check_inputs, cuda_graphs, parallel_vae, expert_parallel)
    if any(state is not None for state in enabled):
        return _attach(pipe, models, enabled, config)
    ensure_process_group(config.timeout_s)
    if config.check_inputs:  # before the groups: a rank with other degrees would build other groups
        check_agreement(_fingerprint(models, config), "xstage_dit.enable's arguments and models",
                        world_group(config.timeout_s))
    groups = build_groups(config.cfg_degree, config.ulysses_degree, config.timeout_s)
    _move_to_rank_device(pipe, models, groups.device)
    choice = resolve_backend(config.backend, groups.device)
    fabric = None
    if needs_fabric(choice, groups.device) and groups.ulysses_group is not None:
        # symmetric memory is set up here, before the denoising loop: rendezvous is a collective
        from .sp.fabric import open_fabric

        fabric = open_fabric(groups.ulysses_group, groups.device, config.timeout_s)
    graphs = config.cuda_graphs and _capturable(groups)
    pairs = PairedCalls()
    for model in models:
        plan = patches.plan_for(model)
        shard = SequenceShard(groups.ulysses_degree, groups.ulysses_rank, groups.ulysses_group)
        attention = UlyssesAttention(shard, choice, plan.text_first, config.fuse_rope, plan.query_key_masks)
        experts = ExpertModes.resolve(config.expert_parallel, groups.ulysses_degree, fabric is not None)
        parts: list[Any] = [AppliedPlan(model, plan, attention, experts, config.fuse_mlp)]
        if config.fuse_mlp:
            parts.append(epilogue_gelus(model))
        if graphs:  # inside the CFG split: a graph holds this rank's branch, the swap stays outside
            parts.append(GraphedForward(model, groups.device, _cross_rank_work(groups, config, fabric),
                                        stateful_hooks, repeated_blocks(model), shard.split_key))
        if groups.cfg_degree > 1:
            parts.append(CfgSplit(model, plan.cfg, groups, pairs))
        setattr(model, _STATE_ATTR, Enabled(config, parts, pairs, [id(pipe)]))
    _enable_pipeline(pipe, models, config, pairs)
    logger.info(
        "xstage_dit enabled on %s: ulysses_degree=%d, cfg_degree=%d, backend=%s, cuda_graphs=%s, parallel_vae=%s",
        ", ".join(type(m).__name__ for m in models), config.ulysses_degree, config.cfg_degree, config.backend,
        graphs, config.parallel_vae,
    )
    return pipe


def _capturable(groups: ParallelGroups) -> bool:
    """A captured forward holds the Ulysses group's collectives: NCCL's can be captured, gloo's (which stage
    through the host) cannot."""
    if groups.ulysses_group is None:
        return True
    backend = str(dist.get_backend(groups.ulysses_group))
    if "nccl" not in backend:
        warn_once(f"xstage_dit: the Ulysses group runs on {backend}, whose collectives cannot be captured in a "
                  "CUDA graph: the transformers run eagerly")
        return False
    return True


def _cross_rank_work(groups: ParallelGroups, config: XStageConfig, fabric: Any) -> CrossRankWork | None:
    """What a replay of a rank's forward waits for across ranks, if anything."""
    if groups.ulysses_group is None:
        return None
    first = groups.rank - groups.ulysses_rank
    peers = f"the other ranks of its Ulysses group (ranks {first}-{first + groups.ulysses_degree - 1})"
    check = None if fabric is None else functools.partial(fabric.raise_if_timed_out, "a CUDA-graph replay")
    return CrossRankWork(groups.rank, peers, config.timeout_s, check)


@dataclass
class Enabled:
    """What `enable` did to one transformer: the resolved config, the changes to undo, the CFG schedule it
    shares with its pipelines, and the ids of the pipeline objects enabled on it."""

    config: XStageConfig
    parts: list[Any]
    pairs: PairedCalls
    pipelines: list[int]


def _enable_pipeline(pipe: Any, models: list[nn.Module], config: XStageConfig, pairs: PairedCalls) -> None:
    """The pipeline's side: before each call the ranks check that they got the same arguments, and the call
    tells the CFG split whether it runs CFG; the VAE decode split across all ranks; progress bars on rank 0
    only."""
    cfg = patches.plan_for(models[0]).cfg
    paired = config.cfg_degree > 1 and cfg.mode == PAIRS
    if paired and isinstance(pipe, ModelMixin):
        warn_once("xstage_dit: cfg_degree=2 on a bare transformer whose pipelines call it once per branch: "
                  "enable the pipeline to split the branches; until then every CFG group computes every call")
    check = config.check_inputs and world_from_env()[0] > 1
    if not isinstance(pipe, ModelMixin) and (paired or check):
        what = f"the arguments of a {type(pipe).__name__} call"
        group = world_group(config.timeout_s) if check else None  # created here: all ranks are in enable

        @contextlib.contextmanager
        def around(arguments: dict[str, Any]) -> Iterator[None]:
            if check:
                check_agreement(call_fingerprint(arguments), what, group)
            uses_cfg = paired and cfg.pipeline_uses_cfg(arguments)
            if paired and not uses_cfg:
                warn_once(f"xstage_dit: a {type(pipe).__name__} call whose arguments turn classifier-free guidance "
                          f"off: with cfg_degree={config.cfg_degree} every CFG group computes every transformer "
                          "call; enable with cfg_degree=1 to split such calls' tokens over every rank")
            with pairs.pipeline_call(uses_cfg) if paired else contextlib.nullcontext():
                yield

        wrap_pipeline_call(pipe, around)
    vae = getattr(pipe, "vae", None)
    if config.parallel_vae and world_from_env()[0] > 1 and getattr(vae, _STATE_ATTR, None) is None:
        rule = vae_rule_for(vae)
        setattr(vae, _STATE_ATTR, ParallelDecode(vae, rule.layers(vae), world_group(config.timeout_s),
                                                 rule.replicated_because))
    if hasattr(pipe, "set_progress_bar_config") and not is_main_process():
        setattr(pipe, _PROGRESS_ATTR, dict(getattr(pipe, "_progress_bar_config", {})))
        pipe.set_progress_bar_config(disable=True)  # progress bars on the main rank only


def _attach(pipe: Any, models: list[nn.Module], enabled: list[Enabled | None], config: XStageConfig) -> Any:
    """`enable` on a pipeline whose transformers another enabled pipeline shares (`from_pipe`): the same
    arguments attach it to their CFG split, other ones are refused."""
    first = enabled[0]
    if first is None or any(state is None or state.pairs is not first.pairs for state in enabled):
        raise RuntimeError("xstage_dit.enable: this pipeline's transformers were not enabled together; "
                           "disable them first")
    if config != first.config:
        raise RuntimeError(f"xstage_dit.enable: the transformers this pipeline shares are enabled with "
                           f"{first.config}; enable it with the same arguments, or disable them first")
    for state in {id(s): s for s in enabled if s is not None}.values():
        state.pipelines.append(id(pipe))
    _enable_pipeline(pipe, models, config, first.pairs)
    return pipe


def disable(pipe: Any) -> Any:
    """Undo `enable`: hooks, processors and attention routing are restored exactly (also for other pipelines
    that share the transformers). The process group stays."""
    for model in _transformers_of(pipe):
        state = getattr(model, _STATE_ATTR, None)
        if state is not None:
            for part in reversed(state.parts):
                part.remove()
            delattr(model, _STATE_ATTR)
    vae = getattr(pipe, "vae", None)
    if getattr(vae, _STATE_ATTR, None) is not None:
        getattr(vae, _STATE_ATTR).remove()
        delattr(vae, _STATE_ATTR)
    if is_wrapped(pipe):
        unwrap_pipeline_call(pipe)
    if hasattr(pipe, _PROGRESS_ATTR):
        pipe._progress_bar_config = getattr(pipe, _PROGRESS_ATTR)
        delattr(pipe, _PROGRESS_ATTR)
    return pipe


def cuda_graph_use(pipe: Any) -> GraphUse:
    """How the transformer forwards of an enabled pipeline (or model) have run since `enable` with CUDA graphs,
    summed over its transformers: calls that replayed a graph, and the others (each input signature's warm-up
    calls and capture, and calls that run eagerly after a fallback), and the same of the block calls in forwards
    that run eagerly. All stay 0 with `cuda_graphs` off."""
    states = [getattr(model, _STATE_ATTR, None) for model in _transformers_of(pipe)]
    if any(state is None for state in states):
        raise ValueError("xstage_dit.cuda_graph_use: call xstage_dit.enable on the pipeline first")
    uses = [part.use for state in states for part in state.parts if isinstance(part, GraphedForward)]
    return GraphUse(*(sum(getattr(use, field.name) for use in uses) for field in fields(GraphUse)))


def is_main_process() -> bool:
    """True on global rank 0 and in a single process: the rank that shows progress and writes files."""
    return world_from_env()[1] == 0
