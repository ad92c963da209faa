"""Sequence-parallel plans: a model family's patch says *where* tokens are split and gathered and *which*
attention modules see the whole sequence; this module applies such a plan to a model with forward hooks
and takes it off again."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..cfg.plan import CfgPlan
from ..hooks.module_forward import forward_signature
from .attention import routing
from .attention.ulysses import GatheredKeysAttention, UlyssesAttention
from .moe.modes import ExpertModes
from .attention.masks import QueryKeyMasks
from .sharding import SequenceShard


@dataclass(frozen=True)
class PerToken:
    """A forward argument that some calls index by token along `dim` (per-token timesteps or modulation) and
    others do not (one value per sample): split with the tokens where it has `dim` and more than one entry
    there, left whole otherwise."""

    dim: int

    def applies_to(self, value: torch.Tensor) -> bool:
        return value.dim() > self.dim and value.shape[self.dim] > 1


@dataclass(frozen=True)
class JointText:
    """A forward argument holding joint attention's text tokens along `dim`, split between the ranks where the
    sequence allows it (`SequenceShard.shard_text`), else whole. List it after the image tokens' argument, and
    only for text without key masks, whose output the model drops at its end."""

    dim: int


@dataclass(frozen=True)
class LocalOrWhole:
    """A forward argument of per-token tensors along `dim` (a ControlNet's residuals: a list of them) that may
    arrive already split: an enabled ControlNet hands over this rank's tokens, which stay as they are; tensors
    holding the whole sequence are split. List it after the image tokens' argument."""

    dim: int


@dataclass(frozen=True)
class TextAndImage:
    """A forward argument indexed by [text, image] tokens along `dim` (e.g. a padding mask over both): its text
    entries stay whole, its image entries (the last ones) are split. List it after the image tokens' argument."""

    dim: int


@dataclass(frozen=True)
class PrefixCount:
    """A forward argument counting tokens at the front of the sequence (HunyuanVideo's first-frame tokens under
    token_replace): it becomes the count of them this rank holds at the front of its chunk."""


_InputDim = int | PerToken | JointText | TextAndImage | LocalOrWhole | PrefixCount


@dataclass(frozen=True)
class PlanContext:
    """What a plan's installs are given: the model's token split, and the modes its MoE layers may run."""

    shard: SequenceShard
    experts: ExpertModes = ExpertModes()


# the layers of `enable` (xstage_dit/layers.py) that a family fills with changes of its own, by the layers' names
FAMILY_CHANGES = "family changes"  # its own modules and helpers (embeddings, sync-free lengths, hooks of its own)
MOE_EXPERTS = "MoE experts"  # its MoE layers through xstage_dit (sharded or replicated, per the context's modes)
PROCESSORS = "processors"  # attention processors of ours set on its modules
FUSED_ROPE = "fused RoPE"  # processors handing q and k over before their norms and rotation (while fuse_rope)
SPLIT_PROJECTION = "split projection"  # blocks projecting attention and MLP outputs apart (while fuse_mlp)
FAMILY_LAYERS = (FAMILY_CHANGES, MOE_EXPERTS, PROCESSORS, FUSED_ROPE, SPLIT_PROJECTION)

# a family's changes for one layer: given the model and the PlanContext, each change undone by `.remove()`
FamilyInstall = Callable[[nn.Module, "PlanContext"], list[Any]]


def model_only(install: Callable[[nn.Module], list[Any]]) -> FamilyInstall:
    """A family's install that needs the model alone, as a FamilyInstall."""
    return lambda model, context: install(model)


@dataclass(frozen=True)
class SequenceParallelPlan:
    """A model family's sequence-parallel plan.

    shard_inputs: module path ("" is the model; "blocks.*" every child of `blocks`) -> {forward argument name:
        sequence dim, PerToken(dim), JointText(dim), TextAndImage(dim), LocalOrWhole(dim) or PrefixCount()} to
        split on entry.
    shard_outputs: module path -> {output index: sequence dim} to split on exit (e.g. rotary tables); a module
        returning one tensor uses index 0.
    gather_outputs: module path -> sequence dim of its output to gather back to the whole sequence, or TextAndImage(dim)
        for an output over [text, image] tokens whose text entries every rank holds.
    attention_modules: the attention modules whose attention must see the whole sequence.
    gathered_key_modules: attention modules whose queries every rank holds whole (a stream that is not split)
        and whose keys and values are split with the tokens: their keys and values are gathered.
    num_heads: attention heads per layer, to check the Ulysses degree (default: the config's
        `num_attention_heads`, which every diffusers DiT has).
    cfg: how the family's pipelines run classifier-free guidance, for CFG parallelism; None for a model whose
        outputs are inputs of the pipeline's transformer, called once per step whatever the guidance (a
        ControlNet: its residuals serve both branches, handed over split): every CFG group computes its calls,
        and it is enabled with its pipeline only.
    call_site: (diffusers module, routing.DISPATCH or routing.SDPA): the name the processors call attention by.
    rotary_site: the diffusers module whose processors call `apply_rotary_emb` by name, routed to our RoPE
        kernel (routing.ROTARY); None where the family rotates some other way.
    text_first: joint attention puts the replicated text tokens before the image tokens (else after).
    query_key_masks: the kind of (B, 1, queries, keys) masks the model builds from a per-token vector
        (masks.QueryKeyMasks), or None: its masks are key-padding masks.
    local_cross_attention: a routed call whose queries and keys differ in count is cross-attention over keys every
        rank holds whole (a Flux IP-Adapter's image-prompt tokens): each rank attends its own queries to them, as
        one process does. For families whose joint attention never has keys-only text.
    check_model: raises, at enable time, for a model configuration the plan cannot shard.
    check_inputs: raises for model inputs the plan cannot shard (called with the bound forward arguments).
    installs: the family's own changes, keyed by the name of the layer of `enable` that installs them (one of
        FAMILY_LAYERS: its own modules and hooks, its MoE layers, attention processors, the fused-RoPE processors,
        the split projection's blocks); the layer decides whether they apply (e.g. fuse_rope, fuse_mlp).
    num_experts: routed experts per MoE layer where the plan's MoE can run expert parallel (0: no MoE layers).
    unshardable_experts: why this model's experts cannot be sharded (expert_parallel=True is then refused at
        enable, before any collective), or None where they can.
    """

    family: str
    call_site: tuple[str, str]
    attention_modules: Callable[[nn.Module], list[nn.Module]]
    cfg: CfgPlan | None
    num_heads: Callable[[nn.Module], int] = lambda model: model.config.num_attention_heads
    gathered_key_modules: Callable[[nn.Module], list[nn.Module]] | None = None
    shard_inputs: dict[str, dict[str, _InputDim]] = field(default_factory=dict)
    shard_outputs: dict[str, dict[int, int]] = field(default_factory=dict)
    gather_outputs: dict[str, int | TextAndImage] = field(default_factory=dict)
    rotary_site: str | None = None
    text_first: bool = True
    query_key_masks: QueryKeyMasks | None = None
    local_cross_attention: bool = False
    check_model: Callable[[nn.Module], None] | None = None
    check_inputs: Callable[[dict[str, Any]], None] | None = None
    installs: Mapping[str, FamilyInstall] = field(default_factory=dict)
    num_experts: Callable[[nn.Module], int] | None = None
    unshardable_experts: Callable[[nn.Module], str | None] | None = None

    def __post_init__(self) -> None:
        unknown = set(self.installs) - set(FAMILY_LAYERS)
        if unknown:
            raise ValueError(f"{self.family}'s plan installs changes for {sorted(unknown)}, which are not layers a "
                             f"family fills; those are {list(FAMILY_LAYERS)}")

    def changes(self, layer: str, model: nn.Module, context: PlanContext) -> list[Any]:
        """The family's changes for `layer` (one of FAMILY_LAYERS), none where it has none."""
        install = self.installs.get(layer)
        return install(model, context) if install is not None else []


def _modules_at(model: nn.Module, path: str) -> list[nn.Module]:
    """The module at `path`, or every child of the module before a trailing ".*"."""
    if path.endswith(".*"):
        return list(model.get_submodule(path.removesuffix(".*")).children())
    return [model.get_submodule(path)]


def _argument_positions(module: nn.Module) -> dict[str, int]:
    return {name: i for i, name in enumerate(forward_signature(module).parameters)}


def _shard_inputs_hook(module: nn.Module, shard: SequenceShard,
                       dims: dict[str, _InputDim]):
    positions = _argument_positions(module)

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        args = list(args)
        for name, dim in dims.items():
            # split the argument where the caller put it: by keyword or by position
            if kwargs.get(name) is not None:
                kwargs[name] = _shard_value(shard, kwargs[name], dim)
            elif positions[name] < len(args) and args[positions[name]] is not None:
                args[positions[name]] = _shard_value(shard, args[positions[name]], dim)
        return tuple(args), kwargs

    return hook


def _shard_value(shard: SequenceShard, value: Any, dim: _InputDim) -> Any:
    """A tensor, or a tuple of tensors (rotary tables), split along `dim`."""
    if isinstance(value, (tuple, list)):
        return type(value)(_shard_value(shard, item, dim) for item in value)
    if isinstance(dim, PrefixCount):
        return shard.local_prefix_len(value)
    if isinstance(dim, JointText):
        return shard.shard_text(value, dim.dim)
    if isinstance(dim, TextAndImage):
        return shard.shard_after_text(value, dim.dim)
    if isinstance(dim, PerToken):
        return shard.shard(value, dim.dim) if dim.applies_to(value) else value
    if isinstance(dim, LocalOrWhole):
        return _local_or_whole(shard, value, dim.dim)
    return shard.shard(value, dim)


def _local_or_whole(shard: SequenceShard, value: torch.Tensor, dim: int) -> torch.Tensor:
    tokens = value.shape[dim]
    if tokens == shard.local_len:
        return value
    if tokens != shard.seq_len:
        raise ValueError(f"xstage_dit: a per-token input with {tokens} tokens, neither the whole sequence's "
                         f"{shard.seq_len} nor this rank's {shard.local_len}")
    return shard.shard(value, dim)


def _check_inputs_hook(module: nn.Module, check: Callable[[dict[str, Any]], None]):
    signature = forward_signature(module)

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        check(dict(signature.bind_partial(*args, **kwargs).arguments))

    return hook


def _shard_outputs_hook(shard: SequenceShard, dims: dict[int, int]):
    def hook(module: nn.Module, args: tuple, output: Any):
        if isinstance(output, torch.Tensor):
            return shard.shard(output, dims[0])
        items = list(output)
        for index, dim in dims.items():
            items[index] = shard.shard(items[index], dim)
        return type(output)(items)

    return hook


def _gather_output_hook(shard: SequenceShard, dim: int | TextAndImage):
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if isinstance(dim, TextAndImage):
            return shard.gather_after_text(output, dim.dim)
        return shard.gather(output, dim)

    return hook


def split_inputs(module: nn.Module, shard: SequenceShard,
                 dims: dict[str, _InputDim]) -> torch.utils.hooks.RemovableHandle:
    """A hook that splits `module`'s forward arguments named in `dims` to this rank's tokens on entry (a plan's
    `shard_inputs`, or a family's install for modules a plan cannot name by path)."""
    return module.register_forward_pre_hook(_shard_inputs_hook(module, shard, dims), with_kwargs=True)


def split_blocks(model: nn.Module, plan: SequenceParallelPlan) -> list[nn.Module]:
    """The blocks of the model's block lists at whose input the plan splits the tokens (e.g. Wan's first block):
    whatever wraps such a list sees its input whole and its output split."""
    return [module for path in plan.shard_inputs if "." in path and not path.endswith(".*")
            for module in _modules_at(model, path)
            if isinstance(model.get_submodule(path.rsplit(".", 1)[0]), nn.ModuleList)]


def check_inputs_hooks(model: nn.Module, plan: SequenceParallelPlan) -> list[torch.utils.hooks.RemovableHandle]:
    """The plan's check of the model's inputs, before anything splits them."""
    if plan.check_inputs is None:
        return []
    return [model.register_forward_pre_hook(_check_inputs_hook(model, plan.check_inputs), with_kwargs=True)]


def token_split_hooks(model: nn.Module, plan: SequenceParallelPlan,
                      shard: SequenceShard) -> list[torch.utils.hooks.RemovableHandle]:
    """The hooks that split the plan's inputs and outputs to this rank's tokens and gather its outputs back."""
    hooks = [split_inputs(module, shard, dims)
             for path, dims in plan.shard_inputs.items() for module in _modules_at(model, path)]
    for path, dims in plan.shard_outputs.items():
        hooks.append(model.get_submodule(path).register_forward_hook(_shard_outputs_hook(shard, dims)))
    for path, dim in plan.gather_outputs.items():
        hooks.append(model.get_submodule(path).register_forward_hook(_gather_output_hook(shard, dim)))
    return hooks


def attention_routes(model: nn.Module, plan: SequenceParallelPlan,
                     attention: UlyssesAttention) -> list[Any]:
    """The plan's attention modules marked for `attention` (and, where tokens are split, the modules whose keys
    are gathered for a GatheredKeysAttention), and the family's attention call site routed."""
    marks = []
    if attention.shard.degree > 1 and plan.gathered_key_modules is not None:
        gathered = GatheredKeysAttention(attention.shard)
        marks.extend(routing.mark_active(module, gathered) for module in plan.gathered_key_modules(model))
    marks.extend(routing.mark_active(module, attention) for module in plan.attention_modules(model))
    return [*marks, routing.route(*plan.call_site)]
