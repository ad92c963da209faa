"""The custom ops a patched model's routed calls run, as `torch.library` ops so that a patched transformer
compiles (e.g. diffusers' `compile_repeated_blocks`) with each as one opaque node: no graph break, and the
compiler never traces collectives, symmetric-memory kernels or our Triton kernels.

A custom op's arguments are tensors, scalars and lists (its scalars keyword-only: torch takes no keyword-only
tensors); it rebuilds the records it works on from them. Callers go through each op's one Python entry, which
takes the records and calls the op by keyword:

- `ulysses_attention` (xstage::ulysses_attention): Ulysses attention and its communication (q, k, v as
  JointTokens, with a joint-attention processor's query and key norms and rotation still to apply where it has
  them: the fused backend applies them in its stores);
- `gathered_keys_attention` (xstage::gathered_keys_attention): replicated queries over every rank's keys
  (all-gathered);
- `local_attention` (xstage::local_attention): degree 1, the backend choice's own kernel (the op is what a
  compiled graph records; eager calls run the kernel directly);
- `rotary` (xstage::rotary_emb): diffusers' interleaved-pair `apply_rotary_emb` in one kernel (routing.ROTARY);
  the op where a graph is compiled, else the kernel launched directly;
- `norm_rope` (xstage::norm_rope): a joint-attention processor's query or key RMSNorms, the concatenation of its
  text and image tokens and the rotation in one kernel (the op or the kernel, as for `rotary`)."""
from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass, fields
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...kernels import triton_runs_on
from ...kernels.rotary_args import JointTokens, NormedTokens, NormRope
from ...logging_utils import warn_once
from ...runtime.distributed import resolve_group, waiting_for
from .backends import Call, LocalAttention, Precision, Strategy, get_choice
from ..fabric import fabric_of
from .layout import UlyssesLayout, WholeKeys
from .local import diffusers_attention, sdpa_bshd
from .reference import over_gathered
from .ring import ring_exchange
from ..sharding import SequenceShard


_LAYOUT_FIELDS = tuple(item.name for item in fields(UlyssesLayout))  # read once: a compiler traces the entry


@dataclass(frozen=True)
class UlyssesOpArgs:
    """xstage::ulysses_attention's arguments, written once: the op's schema, its Python entry and its fake are made
    from these fields. The tensors come first (a custom op takes no keyword-only tensors; the rest are keyword-only):
    q's, k's and v's parts, q's and k's NormRope where `cos` is given, a text mask, whole keys; then the layout's
    fields, the choice's name, the groups' names."""

    query_parts: list[torch.Tensor]
    key_parts: list[torch.Tensor]
    value_parts: list[torch.Tensor]
    query_norm_weights: list[torch.Tensor]
    key_norm_weights: list[torch.Tensor]
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    text_mask: torch.Tensor | None
    whole_key: torch.Tensor | None
    whole_value: torch.Tensor | None
    query_norm_eps: list[float]
    key_norm_eps: list[float]
    norm_across_heads: bool
    text_len: int
    seq_len: int
    local_len: int
    degree: int
    rank: int
    text_first: bool
    text_queries: bool
    ring_degree: int
    ring_rank: int
    backend: str
    group_name: str
    scale: float | None
    attention_backend: str | None
    pair_bias: bool
    ring_group_name: str
    fp8_payloads: bool

    @classmethod
    def of(cls, query: JointTokens, key: JointTokens, value: JointTokens, layout: UlyssesLayout,
           text_mask: torch.Tensor | None, backend: str, group: dist.ProcessGroup | None, scale: float | None,
           attention_backend: str | None, pair_bias: bool, ring_group: dist.ProcessGroup | None,
           whole: WholeKeys | None, fp8_payloads: bool) -> UlyssesOpArgs:
        query_norm, key_norm = query.norm_rope, key.norm_rope
        return cls(
            query_parts=list(query.parts), key_parts=list(key.parts), value_parts=list(value.parts),
            query_norm_weights=[] if query_norm is None else list(query_norm.weights),
            key_norm_weights=[] if key_norm is None else list(key_norm.weights),
            cos=None if query_norm is None else query_norm.cos, sin=None if query_norm is None else query_norm.sin,
            text_mask=text_mask, whole_key=None if whole is None else whole.key,
            whole_value=None if whole is None else whole.value,
            query_norm_eps=[] if query_norm is None else list(query_norm.eps),
            key_norm_eps=[] if key_norm is None else list(key_norm.eps),
            norm_across_heads=query_norm is not None and query_norm.across_heads,
            **{name: getattr(layout, name) for name in _LAYOUT_FIELDS},
            backend=backend, group_name="" if group is None else group.group_name, scale=scale,
            attention_backend=attention_backend, pair_bias=pair_bias,
            ring_group_name="" if ring_group is None else ring_group.group_name, fp8_payloads=fp8_payloads)

    @property
    def layout(self) -> UlyssesLayout:
        return UlyssesLayout(**{name: getattr(self, name) for name in _LAYOUT_FIELDS})

    def tokens(self) -> tuple[JointTokens, JointTokens, JointTokens]:
        """q, k and v as their joint tokens (q's and k's with their NormRope where `cos` is given)."""
        def joint(parts: list[torch.Tensor], weights: list[torch.Tensor], eps: list[float]) -> JointTokens:
            return JointTokens(tuple(parts), None if self.cos is None else
                               NormRope(tuple(weights), tuple(eps), self.cos, self.sin, self.norm_across_heads))

        return (joint(self.query_parts, self.query_norm_weights, self.query_norm_eps),
                joint(self.key_parts, self.key_norm_weights, self.key_norm_eps), JointTokens(tuple(self.value_parts)))

    @property
    def whole(self) -> WholeKeys | None:
        return None if self.whole_key is None else WholeKeys(self.whole_key, self.whole_value)


def _op_signature(record: type) -> inspect.Signature:
    """A custom op's signature from a record's fields: its tensors positional, everything after them keyword-only
    (torch.library infers the op's schema from it)."""
    hints = typing.get_type_hints(record)
    keyword_only = False
    parameters = []
    for item in fields(record):
        keyword_only = keyword_only or "Tensor" not in str(hints[item.name])
        kind = inspect.Parameter.KEYWORD_ONLY if keyword_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
        parameters.append(inspect.Parameter(item.name, kind, annotation=hints[item.name]))
    return inspect.Signature(parameters, return_annotation=torch.Tensor)


def ulysses_attention(query: JointTokens, key: JointTokens, value: JointTokens, layout: UlyssesLayout,
                      text_mask: torch.Tensor | None, backend: str, group: dist.ProcessGroup | None,
                      scale: float | None, attention_backend: str | None, pair_bias: bool = False,
                      ring_group: dist.ProcessGroup | None = None, whole: WholeKeys | None = None,
                      fp8_payloads: bool = False) -> torch.Tensor:
    """Ulysses attention of q, k and v as their joint tokens (1 or 2 parts (B, rows, H, D) each), through
    xstage::ulysses_attention. Where q and k come with a NormRope (both, sharing the tables and `across_heads`:
    a joint-attention processor's prologue), a strategy with a joint entry (the fused one) applies it in its stores
    and any other gets it applied first (the norm + RoPE kernel, a concatenation). `backend` names the choice
    (sp/attention/backends.py) that picks the strategy for this call; `attention_backend`, the diffusers
    attention backend the user chose for the model, if any; `pair_bias`: `text_mask` is the text tokens' factor
    of a pair bias (masks.QueryKeyMasks.PAIR_BIAS), which strategies that support it attend with. `group`: the
    Ulysses group (None at Ulysses degree 1); `ring_group`: the ring's, where `layout.ring_degree` is above 1
    (ring.py); `whole`: keys and values every rank holds whole, attended besides the sequence's; `fp8_payloads`:
    the exchanged payloads travel in FP8 where the strategy sends them so (Strategy.sends_fp8_payloads)."""
    args = UlyssesOpArgs.of(query, key, value, layout, text_mask, backend, group, scale, attention_backend, pair_bias,
                            ring_group, whole, fp8_payloads)
    values = {name: getattr(args, name) for name in _ULYSSES_SIGNATURE.parameters}
    return ulysses_attention_op(*[values.pop(name) for name in _ULYSSES_TENSORS], **values)


def _ulysses_attention(*args: object, **kwargs: object) -> torch.Tensor:
    """`ulysses_attention` inside the op, from its arguments (UlyssesOpArgs)."""
    op = UlyssesOpArgs(*args, **kwargs)
    layout, whole, (query, key, value) = op.layout, op.whole, op.tokens()
    group = resolve_group(op.group_name) if op.group_name else None
    ring_group = resolve_group(op.ring_group_name) if op.ring_group_name else None
    ring_fabric = fabric_of(op.ring_group_name) if ring_group is not None and op.query_parts[0].is_cuda else None
    call = Call(op.query_parts[0], layout, fabric_ready=fabric_of(op.group_name) is not None,
                ring_fabric_ready=ring_fabric is not None, pair_bias=op.pair_bias, masked=op.text_mask is not None,
                whole_keys=whole is not None, fp8_payloads=op.fp8_payloads)
    chosen = get_choice(op.backend).pick(call)
    payloads_in_fp8 = chosen.sends_fp8_payloads(call)
    scale, text_mask = op.scale, op.text_mask
    if call.ring:
        return ring_exchange(_joined(query), _joined(key), _joined(value), layout, group, ring_group, scale,
                             text_mask, chosen.exchange_around(), text_factor=op.pair_bias, whole=whole,
                             stores=ring_fabric if chosen.stores_ring(call) else None,
                             fp8=chosen.precision is Precision.FP8)
    attend = gathered_attention(chosen, op.attention_backend)
    if not call.own_call:  # its exchange around an attention that takes the pair bias or the whole keys
        return chosen.exchange(_joined(query), _joined(key), _joined(value), layout, group,
                               over_gathered(layout, scale, text_mask, attend, op.pair_bias, whole))
    if payloads_in_fp8:  # its output is its own
        return chosen.fp8_payloads(query, key, value, layout, group, scale, text_mask)
    if chosen.joint is not None:
        out = chosen.joint(query, key, value, layout, group, scale, text_mask)
    else:
        out = chosen.ulysses(_joined(query), _joined(key), _joined(value), layout, group, scale, text_mask, attend)
    # a custom op owns its output: a symmetric strategy's is a reused fabric buffer
    return out.clone() if chosen.symmetric else out


def _ulysses_attention_fake(*args: object, **kwargs: object) -> torch.Tensor:
    parts = UlyssesOpArgs(*args, **kwargs).query_parts
    batch, _, heads, head_dim = parts[0].shape
    return parts[0].new_empty(batch, sum(part.shape[1] for part in parts), heads, head_dim)


_ULYSSES_SIGNATURE = _ulysses_attention.__signature__ = _op_signature(UlyssesOpArgs)
_ULYSSES_TENSORS = tuple(name for name, parameter in _ULYSSES_SIGNATURE.parameters.items()
                         if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
ulysses_attention_op = torch.library.custom_op("xstage::ulysses_attention", mutates_args=())(_ulysses_attention)
ulysses_attention_op.register_fake(_ulysses_attention_fake)


def _joined(tokens: JointTokens) -> torch.Tensor:
    """The one tensor JointTokens stand for: their norm + rotation by the norm + RoPE kernel, or a norm across
    heads as the model's RMSNorm module computes it and then the RoPE kernel."""
    norm_rope = tokens.norm_rope
    if norm_rope is None:
        return tokens.parts[0] if len(tokens.parts) == 1 else torch.cat(tokens.parts, dim=1)
    if not norm_rope.across_heads:
        return _rotary.norm_rotate(tokens.normed_parts(), norm_rope.cos, norm_rope.sin)
    (x,) = tokens.parts
    normed = F.rms_norm(x.flatten(2), norm_rope.weights[0].shape, norm_rope.weights[0], norm_rope.eps[0])
    return _rotary.rotate(normed.unflatten(2, x.shape[2:]), norm_rope.cos, norm_rope.sin, 1)


def prologue_kernels_run(tokens: JointTokens) -> bool:
    """Whether our kernels take the norm + rotation of `tokens` (q or k with a NormRope): to apply them in the
    fused stores, or to join them first for another backend."""
    norm_rope = tokens.norm_rope
    if not norm_rope.across_heads:
        return norm_rope_kernel_runs(tokens.normed_parts(), norm_rope.cos, norm_rope.sin)
    x, weight = tokens.parts[0], norm_rope.weights[0]
    return (len(tokens.parts) == 1 and weight.shape == (x.shape[2] * x.shape[3],) and weight.stride(-1) == 1
            and weight.device == x.device and rotary_kernel_runs(x, norm_rope.cos, norm_rope.sin, 1))


def gathered_keys_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, shard: SequenceShard,
                            scale: float | None, attention_backend: str | None) -> torch.Tensor:
    """Whole (replicated) queries over keys and values split with the tokens as `shard` splits them, (B, L, H, D)
    per rank, through xstage::gathered_keys_attention: every rank's keys and values are all-gathered (padding
    dropped) and attended here; every rank computes the same output."""
    return gathered_keys_attention_op(query=query, key=key, value=value, seq_len=shard.seq_len,
                                      degree=shard.degree, rank=shard.rank, group_name=shard.group.group_name,
                                      scale=scale, attention_backend=attention_backend)


@torch.library.custom_op("xstage::gathered_keys_attention", mutates_args=())
def gathered_keys_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, seq_len: int,
                               degree: int, rank: int, group_name: str, scale: float | None,
                               attention_backend: str | None) -> torch.Tensor:
    shard = SequenceShard(degree, rank, resolve_group(group_name))
    shard.seq_len = seq_len
    with waiting_for(lambda: "the other ranks' keys and values for an attention over all their tokens"):
        key, value = shard.gather(torch.stack([key, value]), 2).unbind(0)  # one collective for both
    attend = sdpa_bshd if attention_backend is None else diffusers_attention(attention_backend)
    return attend(query, key, value, None, scale)


@gathered_keys_attention_op.register_fake
def _(query, key, value, *, seq_len, degree, rank, group_name, scale, attention_backend):
    return torch.empty_like(query)


def gathered_attention(chosen: Strategy, attention_backend: str | None) -> LocalAttention:
    """What a strategy attends the gathered heads with: an FP8 strategy's FP8 kernel (its `local`); else the
    user's diffusers attention backend where one was chosen, else SDPA. (A strategy with its own kernel says once
    that it replaces the user's backend.)"""
    if attention_backend is not None and chosen.own_attention:
        warn_once(f"xstage_dit backend {chosen.name!r} attends with its own kernel, in place of the attention "
                  f"backend {attention_backend!r} set on the model")
    if chosen.precision is Precision.FP8:
        return chosen.local
    return sdpa_bshd if attention_backend is None else diffusers_attention(attention_backend)


def local_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                    backend: str, scale: float | None, pair_bias: bool = False) -> torch.Tensor:
    """Degree 1: attention of the whole sequence by the kernel of the strategy that choice `backend` picks (a
    model with an attention backend of the user's runs that instead: UlyssesAttention); `pair_bias`: `attn_mask`
    is a pair bias (masks.QueryKeyMasks.PAIR_BIAS). Through the custom op where a graph is being compiled (which
    keeps the choice and our kernels opaque), else directly (eager calls skip the op's dispatch)."""
    if torch.compiler.is_compiling():
        return local_attention_op(query=query, key=key, value=value, attn_mask=attn_mask, backend=backend,
                                  scale=scale, pair_bias=pair_bias)
    return _local_attention(query, key, value, attn_mask, backend, scale, pair_bias)


def _local_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                     backend: str, scale: float | None, pair_bias: bool) -> torch.Tensor:
    chosen = get_choice(backend).pick(Call(query, pair_bias=pair_bias,
                                           masked=attn_mask is not None and not pair_bias))
    return chosen.local(query, key, value, attn_mask, scale)


@torch.library.custom_op("xstage::local_attention", mutates_args=())
def local_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                       *, backend: str, scale: float | None, pair_bias: bool) -> torch.Tensor:
    out = _local_attention(query, key, value, attn_mask, backend, scale, pair_bias)
    like = torch.empty_like(query)
    if out.stride() == like.stride():
        return out
    # the compiled graph was promised query's layout (the fake below); SDPA returns its own
    return like.copy_(out)


@local_attention_op.register_fake
def _(query, key, value, attn_mask, *, backend, scale, pair_bias):
    return torch.empty_like(query)


_TRITON_RUNS_ON_CPU = triton_runs_on(torch.device("cpu"))  # read once: routed calls ask on every call
try:
    from ...kernels import rotary as _rotary
except ImportError:  # Triton is optional: without it the routed calls run diffusers' code
    _rotary = None


def _rope_kernel_runs(on_gpu: bool, accepts: Callable[[], bool], refusal: Callable[[], str]) -> bool:
    """Whether a kernel of kernels/rotary.py runs a call: on a GPU (or in Triton's CPU interpreter) for inputs
    `accepts`; inputs it cannot take are said once (not while a graph is traced: the compiler cannot trace
    logging)."""
    if _rotary is None or not (on_gpu or _TRITON_RUNS_ON_CPU):
        return False
    if accepts():
        return True
    if not torch.compiler.is_compiling():
        warn_once(refusal())
    return False


def rotary_kernel_runs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sequence_dim: int) -> bool:
    """Whether the RoPE kernel takes these inputs."""
    return _rope_kernel_runs(
        x.is_cuda, lambda: _rotary.rotary_accepts(x, cos, sin, sequence_dim),
        lambda: f"xstage_dit: the RoPE kernel does not take x {tuple(x.shape)} {x.dtype} with tables "
                f"{tuple(cos.shape)} {cos.dtype}; running diffusers' apply_rotary_emb")


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sequence_dim: int) -> torch.Tensor:
    """The RoPE kernel for inputs `rotary_kernel_runs` took: through the custom op where a graph is being
    compiled, else launched directly (the custom op's eager dispatch costs about as much host time as the launch:
    docs/benchmarks/host-h200.md)."""
    if torch.compiler.is_compiling():
        return rotary_emb_op(x=x, cos=cos, sin=sin, sequence_dim=sequence_dim)
    return _rotary.rotate(x, cos, sin, sequence_dim)


@torch.library.custom_op("xstage::rotary_emb", mutates_args=())
def rotary_emb_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, sequence_dim: int) -> torch.Tensor:
    return _rotary.rotary_interleaved(x, cos, sin, sequence_dim)


@rotary_emb_op.register_fake
def _(x, cos, sin, *, sequence_dim):
    return torch.empty_like(x)


def norm_rope_kernel_runs(parts: Sequence[NormedTokens], cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the norm + RoPE kernel takes these inputs."""
    return _rope_kernel_runs(
        parts[0].tokens.is_cuda, lambda: _rotary.norm_rope_accepts(parts, cos, sin),
        lambda: f"xstage_dit: the norm + RoPE kernel does not take tokens "
                f"{[(tuple(part.tokens.shape), part.tokens.dtype) for part in parts]} with tables "
                f"{tuple(cos.shape)} {cos.dtype}; running the model's norms and apply_rotary_emb")


def norm_rope(parts: Sequence[NormedTokens], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The parts normalised, concatenated and rotated (kernels/rotary.py `norm_rotate`), for inputs
    `norm_rope_kernel_runs` took; through the custom op where a graph is being compiled."""
    if not torch.compiler.is_compiling():
        return _rotary.norm_rotate(parts, cos, sin)
    return norm_rope_op(tokens=[part.tokens for part in parts], weights=[part.weight for part in parts],
                        eps=[part.eps for part in parts], cos=cos, sin=sin)


@torch.library.custom_op("xstage::norm_rope", mutates_args=())
def norm_rope_op(tokens: list[torch.Tensor], weights: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, *,
                 eps: list[float]) -> torch.Tensor:
    parts = [NormedTokens(tokens=part, weight=weight, eps=part_eps)
             for part, weight, part_eps in zip(tokens, weights, eps)]
    return _rotary.norm_rotate(parts, cos, sin)


@norm_rope_op.register_fake
def _(tokens, weights, cos, sin, *, eps):
    return tokens[0].new_empty(tokens[0].shape[0], cos.shape[0], *tokens[0].shape[2:])
