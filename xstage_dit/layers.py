"""Everything `enable` installs, as one ordered table of named layers.

Each layer's `install` gets the job's record and returns its changes (each undone by `.remove()`; none where the
layer does not apply to this model or job). `enable` installs the table top to bottom, keeping each layer's
changes on the target's `LayerStack` (hooks/layers.py); `disable` removes them bottom to top, through that one
path. The order is declared here once, each layer with the reason for its place."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch.distributed as dist
from torch import nn

from .cfg.plan import BATCH, PAIRS
from .cfg.split import CfgSplit, PairedCalls
from .config import XStageConfig
from .fusions.gelu import epilogue_gelus
from .hooks.layers import Change
from .hooks.pipeline_call import WrappedPipelineCall
from .logging_utils import warn_once
from .patches.vaes import vae_rule_for
from .precision.linear import Fp8Linears
from .precision.steps import FullPrecisionSteps, StepPrecision
from .runtime import ParallelGroups
from .runtime.agreement import call_fingerprint, check_agreement
from .runtime.cuda_graphs import CrossRankWork, GraphedForward, repeated_blocks
from .runtime.distributed import world_group
from .runtime.model_changes import ChangesSinceEnable
from .sp.attention import routing
from .sp.attention.ulysses import UlyssesAttention
from .sp.cache_hooks import CfgBranches, SharedCacheDecisions, stateful_hooks
from .sp.fabric import fabric_of, memory_epoch
from .sp.moe.modes import ExpertModes
from .sp.plan import (FAMILY_CHANGES, FUSED_ROPE, MOE_EXPERTS, PROCESSORS, SPLIT_PROJECTION, PlanContext,
                      SequenceParallelPlan, attention_routes, check_inputs_hooks, split_blocks, token_split_hooks)
from .sp.sharding import SequenceShard
from .vae.decode import ParallelDecode


@dataclass(frozen=True)
class ModelJob:
    """What one transformer's layers are installed from: the model and its family's plan, the resolved config,
    the job's groups, the model's token split and attention, the modes its MoE layers may run, the Ulysses group's
    symmetric-memory fabric (or None), the CFG schedule the model shares with its pipelines, and the record of
    whether the current step runs its FP8 parts (which every FP8 part reads, precision/steps.py)."""

    model: nn.Module
    plan: SequenceParallelPlan
    config: XStageConfig
    groups: ParallelGroups
    shard: SequenceShard
    attention: UlyssesAttention
    experts: ExpertModes
    fabric: Any
    pairs: PairedCalls
    precision: StepPrecision

    @property
    def context(self) -> PlanContext:
        return PlanContext(self.shard, self.experts)

    @property
    def split(self) -> bool:
        """Whether this model's tokens are split between ranks."""
        return self.shard.degree > 1


@dataclass(frozen=True)
class PipelineJob:
    """What a pipeline's own layers are installed from: the pipeline, its enabled transformers by attribute name and
    their family plan, the resolved config, the CFG schedule, the job's world size, and the step-precision
    records of all its enabled models (ControlNets' too)."""

    pipe: Any
    models: dict[str, nn.Module]
    plan: SequenceParallelPlan
    config: XStageConfig
    pairs: PairedCalls
    world_size: int
    rank: int
    precisions: list[StepPrecision]


@dataclass(frozen=True)
class Layer:
    """A named layer of `enable`: `install(job)` returns its changes; `why_here` says why it sits where it does."""

    name: str
    install: Callable[[Any], list[Change]]
    why_here: str


def _family(layer: str) -> Callable[[ModelJob], list[Change]]:
    """A layer holding the family's own changes for it, wherever the family has some."""
    def install(job: ModelJob) -> list[Change]:
        return job.plan.changes(layer, job.model, job.context)

    return install


def _fp8_linear(job: ModelJob) -> list[Change]:
    if "linear" not in job.config.fp8:
        return []
    return [Fp8Linears(job.model, job.precision, keep_full_precision=job.config.fp8_full_precision_steps > 0)]


def _input_checks(job: ModelJob) -> list[Change]:
    return check_inputs_hooks(job.model, job.plan)


def _token_split(job: ModelJob) -> list[Change]:
    return token_split_hooks(job.model, job.plan, job.shard) if job.split else []


def _cache_decisions(job: ModelJob) -> list[Change]:
    # a model without a CFG plan (a ControlNet) runs its calls whole in every CFG group
    split_cfg = job.groups.cfg_degree > 1 and job.plan.cfg is not None
    if not (job.split or split_cfg):  # nothing split: the caches' own decisions are one process's
        return []
    cfg = CfgBranches(batch_group=job.groups.cfg_group if split_cfg and job.plan.cfg.mode == BATCH else None,
                      paired=split_cfg and job.plan.cfg.mode == PAIRS)
    return [SharedCacheDecisions(job.model, job.shard, split_blocks(job.model, job.plan), cfg)]


def _attention_routing(job: ModelJob) -> list[Change]:
    return attention_routes(job.model, job.plan, job.attention)


def _fused_rope(job: ModelJob) -> list[Change]:
    if not job.config.fuse_rope:
        return []
    processors = job.plan.changes(FUSED_ROPE, job.model, job.context)
    route = [routing.RotaryRoute(job.plan.rotary_site, job.attention)] if job.plan.rotary_site is not None else []
    return [*processors, *route]


def _gelu_epilogue(job: ModelJob) -> list[Change]:
    return [epilogue_gelus(job.model)] if job.config.fuse_mlp else []


def _split_projection(job: ModelJob) -> list[Change]:
    return job.plan.changes(SPLIT_PROJECTION, job.model, job.context) if job.config.fuse_mlp else []


def _capturable(groups: ParallelGroups) -> bool:
    """A captured forward holds the sequence's collectives (the Ulysses all-to-alls, a ring's point-to-point
    sends): NCCL's can be captured, gloo's (which stage through the host) cannot."""
    if groups.sequence_group is None:
        return True
    backend = str(dist.get_backend(groups.sequence_group))
    if "nccl" not in backend:
        sends = " and point-to-point sends" if groups.ring_degree > 1 else ""
        warn_once(f"xstage_dit: the sequence's ranks run on {backend}, whose collectives{sends} cannot be captured "
                  "in a CUDA graph: the transformers run eagerly")
        return False
    return True


def _cross_rank_work(job: ModelJob) -> CrossRankWork | None:
    """What a replay of a rank's forward waits for across ranks, if anything."""
    groups = job.groups
    if groups.sequence_group is None:
        return None
    first = groups.rank - groups.sequence_rank
    peers = f"the other ranks of its sequence (ranks {first}-{first + groups.sequence_degree - 1})"
    # the fabrics whose barrier kernels a replay runs: the Ulysses group's, and the ring group's where its blocks
    # travel by stores
    ring_fabric = None if groups.ring_group is None else fabric_of(groups.ring_group.group_name)
    fabrics = [fabric for fabric in (job.fabric, ring_fabric) if fabric is not None]

    def check() -> None:
        for fabric in fabrics:
            fabric.raise_if_timed_out("a CUDA-graph replay")

    return CrossRankWork(groups.rank, peers, job.config.timeout_s, check if fabrics else None, memory_epoch)


def _cuda_graphs(job: ModelJob) -> list[Change]:
    if not (job.config.cuda_graphs and _capturable(job.groups)):
        return []
    precision, split_key = job.precision.key, job.shard.split_key
    return [GraphedForward(job.model, job.groups.device, _cross_rank_work(job), stateful_hooks,
                           repeated_blocks(job.model), lambda: (split_key(), precision()), precision)]


def _cfg_split(job: ModelJob) -> list[Change]:
    if job.groups.cfg_degree == 1 or job.plan.cfg is None:
        return []
    return [CfgSplit(job.model, job.plan.cfg, job.groups, job.pairs)]


MODEL_LAYERS: tuple[Layer, ...] = (
    Layer(FAMILY_CHANGES, _family(FAMILY_CHANGES),
          "first: a family's own modules and helpers (embeddings on the device, sync-free text lengths, its own "
          "hooks) are what every later layer runs"),
    Layer("FP8 linear", _fp8_linear,
          "before the MoE layers and the fusions, which take the Linear weights as they find them, and before "
          "graphs capture"),
    Layer(MOE_EXPERTS, _family(MOE_EXPERTS),
          "before anything that runs the blocks: the MoE layers' weights and forwards are set once"),
    Layer(PROCESSORS, _family(PROCESSORS), "attention processors of ours, on the modules routing marks next"),
    Layer("input checks", _input_checks,
          "before the token split: a forward pre-hook registered first sees the inputs whole"),
    Layer("token split", _token_split,
          "hooks that split inputs to this rank's tokens and gather outputs; only where tokens are split"),
    Layer("cache decisions", _cache_decisions,
          "diffusers' and cache-dit's caches decide on the whole sequence where tokens are split and the whole "
          "batch where the CFG split halves it (cache-dit's own reduction would average over every rank)"),
    Layer("attention routing", _attention_routing,
          "marks the plan's attention modules and rebinds the family's attention call site to them"),
    Layer(FUSED_ROPE, _fused_rope,
          "after routing: our RoPE kernel and norm + RoPE processors run for the marked modules' calls"),
    Layer("GELU epilogue", _gelu_epilogue, "feed-forward classes swapped; before graphs capture their forwards"),
    Layer(SPLIT_PROJECTION, _split_projection, "single-stream block classes swapped; before graphs likewise"),
    Layer("CUDA graphs", _cuda_graphs,
          "around the hooked forward, so a graph holds this rank's whole branch, collectives included"),
    Layer("CFG split", _cfg_split,
          "outermost: its two calls per step do different things on different ranks, which no graph can hold"),
)


class MainRankProgress:
    """Progress bars off on every rank but the main one, until `remove()` gives the pipeline its settings back."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe
        self._saved = dict(getattr(pipe, "_progress_bar_config", {}))
        pipe.set_progress_bar_config(disable=True)

    def remove(self) -> None:
        self._pipe._progress_bar_config = self._saved


def _pipeline_call(job: PipelineJob) -> list[Change]:
    """Before each call the ranks check that they got the same arguments and that their transformers changed the
    same way since `enable` (adapters, weights), and the call tells the CFG split whether it runs CFG."""
    config, pipe, cfg = job.config, job.pipe, job.plan.cfg
    paired = config.cfg_degree > 1 and cfg.mode == PAIRS
    check = config.check_inputs and job.world_size > 1
    if not (paired or check):
        return []
    what = f"the arguments and models of a {type(pipe).__name__} call"
    group = world_group(config.timeout_s) if check else None  # created here: all ranks are in enable
    watched = [ChangesSinceEnable(model, f"{name} ({type(model).__name__})")
               for name, model in job.models.items()] if check else []

    @contextlib.contextmanager
    def around(arguments: dict[str, Any]) -> Iterator[None]:
        if check:
            fingerprint = call_fingerprint(arguments)
            for model in watched:
                model.add_to(fingerprint)
            check_agreement(fingerprint, what, group)
        uses_cfg = paired and cfg.pipeline_uses_cfg(arguments)
        if paired and not uses_cfg:
            warn_once(f"xstage_dit: a {type(pipe).__name__} call whose arguments turn classifier-free guidance "
                      f"off: with cfg_degree={config.cfg_degree} every CFG group computes every transformer "
                      "call; enable with cfg_degree=1 to split such calls' tokens over every rank")
        with job.pairs.pipeline_call(uses_cfg) if paired else contextlib.nullcontext():
            yield

    return [WrappedPipelineCall(pipe, around), *watched]


def _fp8_steps(job: PipelineJob) -> list[Change]:
    steps = job.config.fp8_full_precision_steps
    return [FullPrecisionSteps(job.pipe, job.precisions, steps)] if job.config.fp8 and steps else []


def _parallel_vae(job: PipelineJob) -> list[Change]:
    vae = getattr(job.pipe, "vae", None)
    if not job.config.parallel_vae or job.world_size == 1 or ParallelDecode.splits(vae):
        return []  # a VAE another enabled pipeline shares is split by that pipeline's layer
    rule = vae_rule_for(vae)
    return [ParallelDecode(vae, rule.layers(vae), world_group(job.config.timeout_s), rule.replicated_because)]


def _main_rank_progress(job: PipelineJob) -> list[Change]:
    if not hasattr(job.pipe, "set_progress_bar_config") or job.rank == 0:
        return []
    return [MainRankProgress(job.pipe)]


PIPELINE_LAYERS: tuple[Layer, ...] = (
    Layer("pipeline call", _pipeline_call,
          "around every call of the pipeline object: the ranks' agreement on the arguments, then the CFG schedule"),
    Layer("FP8 steps", _fp8_steps,
          "outside the pipeline call's checks: they see the call as it runs, with its step callback (ours, around "
          "the caller's)"),
    Layer("parallel VAE", _parallel_vae, "the decode split by rows across all ranks, after the denoising loop"),
    Layer("main-rank progress", _main_rank_progress, "progress bars on the main rank only"),
)


def layer_names() -> list[str]:
    """Every registered layer's name, in installation order: the transformers' layers, then the pipeline's."""
    return [layer.name for layer in (*MODEL_LAYERS, *PIPELINE_LAYERS)]
