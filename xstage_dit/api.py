"""enable / disable / installed_layers / cuda_graph_use / is_main_process: the public entry points."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any

import torch
from diffusers import ModelMixin
from torch import nn

from . import patches
from .burst_gap.planner import widest_ulysses
from .cfg.plan import PAIRS
from .cfg.split import PairedCalls
from .config import XStageConfig
from .hooks.layers import attach_stack, detach_stack, stack_of
from .layers import MODEL_LAYERS, PIPELINE_LAYERS, Layer, ModelJob, PipelineJob
from .logging_utils import logger, warn_once
from .patches.vaes import supported_vaes, vae_rule_for
from .precision.linear import check_fp8_linear
from .precision.steps import StepPrecision, takes_step_callbacks
from .runtime import build_groups, ensure_process_group, world_from_env
from .runtime.agreement import Fingerprint, check_agreement, weight_kinds, weights_checksum
from .runtime.cuda_graphs import GraphUse
from .runtime.distributed import ParallelGroups, every_rank_joining, forget_groups, local_device, world_group
from .sp.attention.backends import BackendChoice, needs_fabric, needs_ring_fabric, resolve_backend
from .sp.attention.ulysses import UlyssesAttention
from .sp.cache_dit_hooks import refuse_other_sequence_parallelism
from .sp.moe.modes import ExpertModes
from .sp.planner import forget_planners
from .sp.sharding import SequenceShard

_STATE_ATTR = "_xstage_dit_applied"
_TRANSFORMER_ATTRS = ("transformer", "transformer_2")


def _refuse_compiled(model: Any, where: str) -> None:
    """torch.compile's wrapper hides the model's class and runs a graph traced before the patches: say what to do."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise TypeError(f"xstage_dit.enable: {where} is a torch.compile'd {type(model._orig_mod).__name__}; call "
                        f"xstage_dit.enable first, or compile after it (e.g. "
                        f"pipe.transformer.compile_repeated_blocks(fullgraph=True), as docs/usage.md shows)")


def _transformers_of(target: Any) -> list[nn.Module]:
    """The models `enable` splits: a bare transformer, or a pipeline's transformers, then its ControlNets."""
    _refuse_compiled(target, "the model")
    if isinstance(target, ModelMixin):
        if patches.is_supported(target) and patches.plan_for(target).cfg is None:
            raise TypeError(f"xstage_dit.enable: a {type(target).__name__} hands its outputs to its pipeline's "
                            f"transformer split between the ranks; enable the pipeline instead")
        return [target]
    found = [getattr(target, name, None) for name in _TRANSFORMER_ATTRS]
    for name, model in zip(_TRANSFORMER_ATTRS, found):
        _refuse_compiled(model, f"pipe.{name}")
    found = [model for model in found if model is not None]
    if not found:
        raise TypeError(
            f"xstage_dit.enable expects a diffusers pipeline with a `transformer` or a diffusers transformer model, "
            f"got {type(target).__name__}"
        )
    return found + _controlnets_of(target)


def _controlnets_of(pipe: Any) -> list[nn.Module]:
    """A pipeline's ControlNet: its `controlnet`, or each net of a multi-ControlNet model."""
    controlnet = getattr(pipe, "controlnet", None)
    if controlnet is None:
        return []
    nets = getattr(controlnet, "nets", None)
    return list(nets) if isinstance(nets, nn.ModuleList) else [controlnet]


@dataclass(frozen=True)
class Degrees:
    """How the ranks of one sequence are split: Ulysses groups of `ulysses` consecutive ranks, `ring` of them in a
    ring."""

    ulysses: int
    ring: int


def _degrees(world_size: int, config: XStageConfig, heads: list[int]) -> Degrees:
    """The degrees the job runs: the ones given, checked against the world and the heads; with none given, Ulysses
    as wide as divides every model's heads within a node (LOCAL_WORLD_SIZE), the ring for the rest."""
    ranks = config.sequence_ranks(world_size)
    ulysses, ring = config.ulysses_degree, config.ring_degree
    if ulysses is None:
        node = int(os.environ.get("LOCAL_WORLD_SIZE", ranks))
        ulysses = ranks // ring if ring is not None else widest_ulysses(ranks, heads, node)
        if ring is None and ulysses < ranks:
            logger.info("xstage_dit: %d ranks a sequence as Ulysses %d x ring %d (the heads %s, %d ranks a node)",
                        ranks, ulysses, ranks // ulysses, "/".join(map(str, sorted(set(heads)))), node)
    return Degrees(ulysses, ranks // ulysses)


def _check_heads(model: nn.Module, heads: int, degrees: Degrees) -> None:
    """Heads must split over the Ulysses degree; otherwise say which Ulysses degrees of this split would work."""
    if heads % degrees.ulysses == 0:
        return
    ranks = degrees.ulysses * degrees.ring
    working = [f"ulysses_degree={d} x ring_degree={ranks // d}" for d in range(1, ranks + 1)
               if ranks % d == 0 and heads % d == 0]
    raise ValueError(f"{type(model).__name__} has {heads} attention heads, which ulysses_degree={degrees.ulysses} "
                     f"cannot split; over these {ranks} ranks these work: {', '.join(working)}")


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
        why = plan.unshardable_experts(model) if plan.unshardable_experts is not None else None
        if why is not None:
            raise ValueError(f"xstage_dit.enable: expert_parallel=True cannot shard {why}")
    return True


def _config_of(config: XStageConfig | None, knobs: dict[str, Any]) -> XStageConfig:
    """The config `enable` was given, with any keywords in place of its fields."""
    if config is not None and not isinstance(config, XStageConfig):
        raise TypeError(f"config must be an xstage_dit.XStageConfig, got {type(config).__name__}")
    unknown = sorted(set(knobs) - set(XStageConfig.knobs()))
    if unknown:
        raise TypeError(f"xstage_dit.enable got unknown keyword(s) {', '.join(unknown)}; its knobs are "
                        f"{', '.join(XStageConfig.knobs())}")
    return dataclasses.replace(config, **knobs) if config is not None else XStageConfig(**knobs)


def _check_fp8(pipe: Any, models: list[nn.Module], config: XStageConfig, choice: BackendChoice) -> None:
    """The FP8 parts asked for must have a path that runs on this job's device, models and backend `choice`; the
    full-precision steps are counted by a pipeline's step callback."""
    if "payloads" in config.fp8 and not any(s.fp8_payloads is not None for s in choice.candidates()):
        raise ValueError(f"fp8=\"payloads\": backend {config.backend!r} sends no FP8 payloads; the fused backend's "
                         f"stores do (backend=\"fused\", or \"auto\" where the planner picks it)")
    if "linear" in config.fp8:
        if config.expert_parallel:
            raise ValueError("fp8='linear' quantizes the experts' Linear layers, which expert_parallel=True cannot "
                             "shard: enable with one or the other")
        for model in models:
            check_fp8_linear(model, local_device())
    if config.fp8 and config.fp8_full_precision_steps and (isinstance(pipe, ModelMixin)
                                                           or not takes_step_callbacks(pipe)):
        what = "a bare transformer" if isinstance(pipe, ModelMixin) else \
            f"a {type(pipe).__name__}, whose call takes no callback_on_step_end"
        raise ValueError(f"fp8_full_precision_steps={config.fp8_full_precision_steps} counts the steps of a "
                         f"pipeline call through its callback_on_step_end; enable was given {what}")


def _resolve(pipe: Any, models: list[nn.Module], config: XStageConfig) -> XStageConfig:
    """The config with every default that depends on the job filled in, checked against the job and the models,
    before any collective."""
    world_size, _ = world_from_env()
    plans = [patches.plan_for(model) for model in models]
    for model, plan in zip(models, plans):
        refuse_other_sequence_parallelism(model, "which xstage_dit.enable cannot take")
        if plan.check_model is not None:
            plan.check_model(model)
    degrees = _degrees(world_size, config, [plan.num_heads(model) for model, plan in zip(models, plans)])
    for model, plan in zip(models, plans):
        _check_heads(model, plan.num_heads(model), degrees)
    cuda_graphs = _cuda_graphs(config.cuda_graphs, local_device())
    choice = resolve_backend(config.backend, local_device(), cuda_graphs, fp8="attention" in config.fp8)
    _check_fp8(pipe, models, config, choice)
    degree = degrees.ulysses * degrees.ring
    return dataclasses.replace(config, ulysses_degree=degrees.ulysses, ring_degree=degrees.ring,
                               cuda_graphs=cuda_graphs,
                               parallel_vae=_parallel_vae(config.parallel_vae, getattr(pipe, "vae", None)),
                               expert_parallel=_expert_parallel(config.expert_parallel, models, degree))


def _fingerprint(models: list[nn.Module], config: XStageConfig) -> Fingerprint:
    """What every rank's `enable` must agree on: every knob of the resolved config, the models' classes and
    weights (quantized ones included: their classes, and the sum of what they store)."""
    fingerprint = Fingerprint()
    for name, value in config.as_dict().items():
        fingerprint.add(name, value)
    for model in models:
        fingerprint.add("model class", type(model).__name__)
        fingerprint.add(f"{type(model).__name__} weights", weights_checksum(model))
        fingerprint.add(f"{type(model).__name__} weights' classes and dtypes", weight_kinds(model))
    return fingerprint


def _move_to_rank_device(target: Any, models: list[nn.Module], device: torch.device) -> None:
    """Under torchrun every rank must own its GPU; a pipeline put on "cuda" lands on cuda:0 on every rank."""
    current = next(models[0].parameters()).device
    if current.type == "cuda" and current != device:
        logger.info("moving the pipeline from %s to this rank's %s", current, device)
        target.to(device)


def _open_ring_fabric(groups: ParallelGroups, may_store: bool, timeout_s: float, holders: list[int]) -> None:
    """The ring group's symmetric memory, over which the ring's key/value blocks travel by remote stores
    (the custom op finds it by the group's name), where its ranks share a node and a strategy the choice may pick
    stores its ring's blocks (`may_store`); elsewhere they travel by point-to-point sends. `holders`: the models
    that hold it until `disable`."""
    from .sp.fabric import open_fabric

    if not groups.ring_within_node:
        logger.info("xstage_dit: the ring spans nodes: its key/value blocks travel by NCCL point-to-point")
    elif may_store:
        open_fabric(groups.ring_group, groups.device, timeout_s, holders)
        logger.info("xstage_dit: the ring's key/value blocks travel by remote stores (its ranks share a node)")


def enable(pipe: Any, config: XStageConfig | None = None, **knobs: Any) -> Any:
    """Run `pipe`'s transformer(s) with Ulysses sequence parallelism across the job's ranks; returns `pipe`.

    `pipe` is a diffusers pipeline (its `transformer` and `transformer_2` are patched) or a bare diffusers
    transformer. Under torchrun / accelerate the default process group is started if the caller has not;
    in a single process the model runs unsplit with xstage_dit's attention. The knobs are `XStageConfig`'s fields,
    given as a config, as keywords, or both (keywords replace the config's fields). Every rank must make the same
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
    `fp8="linear"` runs the Linear layers of the transformers' blocks as torchao's FP8 GEMMs (precision/linear.py;
    a GPU of compute capability 8.9 or above, a bfloat16 model); `fp8="attention"` attends with the FP8 variant of
    the backend (our FP8 attention kernel, kernels/attention.py); `fp8_full_precision_steps=k` keeps the first and
    last k steps of each pipeline call without FP8 (precision/steps.py).

    A pipeline that shares enabled transformers (e.g. one made by `from_pipe`) is enabled with the same
    arguments: its calls then take part in the CFG split too; other arguments are refused."""
    models = _transformers_of(pipe)
    enabled = [getattr(model, _STATE_ATTR, None) for model in models]
    if any(state is not None and id(pipe) in state.pipelines for state in enabled) or (
            isinstance(pipe, ModelMixin) and enabled[0] is not None):
        raise RuntimeError(f"xstage_dit.enable was already called on this {type(models[0]).__name__}")
    config = _resolve(pipe, models, _config_of(config, knobs))
    if any(state is not None for state in enabled):
        return _attach(pipe, models, enabled, config)
    with every_rank_joining("xstage_dit.enable", config.timeout_s):
        ensure_process_group(config.timeout_s)
        if config.check_inputs:  # before the groups: a rank with other degrees would build other groups
            check_agreement(_fingerprint(models, config), "xstage_dit.enable's arguments and models",
                            world_group(config.timeout_s))
        groups = build_groups(config.cfg_degree, config.ulysses_degree, config.timeout_s, config.ring_degree)
        _move_to_rank_device(pipe, models, groups.device)
        choice = resolve_backend(config.backend, groups.device)
        # the FP8 variant attends the steps that run attention in FP8; it keeps the choice's exchange and fabrics
        fp8_choice = resolve_backend(config.backend, groups.device, fp8=True) if "attention" in config.fp8 else None
        fabric = None
        holders = [id(model) for model in models]  # the models hold the fabrics until `disable`
        if groups.ulysses_group is not None and needs_fabric(choice, groups.device, ring=groups.ring_degree > 1):
            if groups.ulysses_within_node:
                # symmetric memory is set up here, before the denoising loop: rendezvous is a collective
                from .sp.fabric import open_fabric

                fabric = open_fabric(groups.ulysses_group, groups.device, config.timeout_s, holders)
            else:
                warn_once("xstage_dit: the Ulysses group spans nodes and symmetric memory spans one: its exchanges "
                          "run over NCCL (the reference and overlap backends), not the fused backend's stores")
        if groups.ring_degree > 1:
            _open_ring_fabric(groups, needs_ring_fabric(choice, groups.device), config.timeout_s, holders)
    pairs = PairedCalls()
    for model in models:
        plan = patches.plan_for(model)
        shard = SequenceShard(groups.sequence_degree, groups.sequence_rank, groups.sequence_group)
        precision = StepPrecision(config.fp8)
        attention = UlyssesAttention(shard, choice, text_first=plan.text_first, query_key_masks=plan.query_key_masks,
                                     ulysses=groups.ulysses, ring=groups.ring,
                                     local_cross_attention=plan.local_cross_attention,
                                     precision=precision, fp8_choice=fp8_choice)
        experts = ExpertModes.resolve(config.expert_parallel, shard.degree, fabric_ready=fabric is not None)
        job = ModelJob(model=model, plan=plan, config=config, groups=groups, shard=shard, attention=attention,
                       experts=experts, fabric=fabric, pairs=pairs, precision=precision)
        _install(model, MODEL_LAYERS, job)
        setattr(model, _STATE_ATTR, Enabled(config, pairs, [id(pipe)], precision))
    _enable_pipeline(pipe, models, config, pairs)
    logger.info(
        "xstage_dit enabled on %s: ulysses_degree=%d, ring_degree=%d, cfg_degree=%d, backend=%s, layers: %s",
        ", ".join(type(m).__name__ for m in models), config.ulysses_degree, config.ring_degree, config.cfg_degree,
        config.backend,
        ", ".join(installed_layers(pipe)),
    )
    return pipe


def _install(target: Any, table: tuple[Layer, ...], job: Any) -> None:
    """Every layer of `table` installed on `target` in order; one that fails takes the ones before it off again."""
    stack = attach_stack(target)
    try:
        for layer in table:
            stack.push(layer.name, layer.install(job))
    except BaseException:
        detach_stack(target)
        raise


@dataclass
class Enabled:
    """What `enable` did to one transformer besides its layers: the resolved config, the CFG schedule it shares with
    its pipelines, the ids of the pipeline objects enabled on it, and the record of whether the current step runs
    its FP8 parts."""

    config: XStageConfig
    pairs: PairedCalls
    pipelines: list[int]
    precision: StepPrecision


def _enable_pipeline(pipe: Any, models: list[nn.Module], config: XStageConfig, pairs: PairedCalls) -> None:
    """The pipeline's own layers (PIPELINE_LAYERS); a bare transformer has none."""
    plan = patches.plan_for(models[0])
    if isinstance(pipe, ModelMixin):
        if config.cfg_degree > 1 and plan.cfg.mode == PAIRS:
            warn_once("xstage_dit: cfg_degree=2 on a bare transformer whose pipelines call it once per branch: "
                      "enable the pipeline to split the branches; until then every CFG group computes every call")
        return
    world_size, rank = world_from_env()
    named = {name: getattr(pipe, name) for name in _TRANSFORMER_ATTRS if getattr(pipe, name, None) in models}
    precisions = [getattr(model, _STATE_ATTR).precision for model in models]
    _install(pipe, PIPELINE_LAYERS, PipelineJob(pipe=pipe, models=named, plan=plan, config=config, pairs=pairs,
                                                world_size=world_size, rank=rank, precisions=precisions))


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
    """Undo `enable`: every layer is removed, last first, and the model is restored exactly (also for other
    pipelines that share the transformers). The symmetric memory the models held is given back (where no other
    enabled model holds it); the process group stays; the library's caches of groups, placement and planners are
    emptied (the next `enable` fills them from the job as it is then)."""
    from .sp.fabric import release_fabrics

    for model in _transformers_of(pipe):
        if getattr(model, _STATE_ATTR, None) is not None:
            detach_stack(model)  # the CUDA graphs that address the fabrics go first
            delattr(model, _STATE_ATTR)
            release_fabrics(id(model))
    if not isinstance(pipe, ModelMixin):
        detach_stack(pipe)
    forget_groups()
    forget_planners()
    return pipe


def installed_layers(pipe: Any) -> list[str]:
    """The names of the layers `enable` installed on a pipeline (or a bare transformer), innermost first: each
    transformer's, then the pipeline's own."""
    targets = [*_transformers_of(pipe), *([] if isinstance(pipe, ModelMixin) else [pipe])]
    return [name for target in targets if stack_of(target) is not None for name in stack_of(target).names()]


def cuda_graph_use(pipe: Any) -> GraphUse:
    """How the transformer forwards of an enabled pipeline (or model) have run since `enable` with CUDA graphs,
    summed over its transformers: calls that replayed a graph, and the others (each input signature's warm-up
    calls and capture, and calls that run eagerly after a fallback), and the same of the block calls in forwards
    that run eagerly. All stay 0 with `cuda_graphs` off."""
    states = [getattr(model, _STATE_ATTR, None) for model in _transformers_of(pipe)]
    if any(state is None for state in states):
        raise ValueError("xstage_dit.cuda_graph_use: call xstage_dit.enable on the pipeline first")
    uses = [graphed.use for model in _transformers_of(pipe) for graphed in stack_of(model).changes_of("CUDA graphs")]
    return GraphUse(*(sum(getattr(use, field.name) for use in uses) for field in fields(GraphUse)))


def is_main_process() -> bool:
    """True on global rank 0 and in a single process: the rank that shows progress and writes files."""
    return world_from_env()[1] == 0
