"""The custom ops a patched model's routed calls run, as `torch.library` ops so that a patched transformer
compiles (e.g. diffusers' `compile_repeated_blocks`) with each as one opaque node: no graph break, and the
compiler never traces collectives, symmetric-memory kernels or our Triton kernels.

- xstage::ulysses_attention: Ulysses attention and its communication (q, k, v as parts, with a joint-attention
  processor's query and key norms and rotation still to apply where it has them: the fused backend applies them
  in its stores);
- xstage::gathered_keys_attention: replicated queries over every rank's keys (all-gathered);
- xstage::local_attention: degree 1, the backend choice's own kernel (what a compiled graph records; eager calls
  run `local_attention` directly);
- xstage::rotary_emb: diffusers' interleaved-pair `apply_rotary_emb` in one kernel (routing.ROTARY), what a
  compiled graph records; eager calls launch the kernel directly (`rotary`);
- xstage::norm_rope: a joint-attention processor's query or key RMSNorms, the concatenation of its text and image
  tokens and the rotation in one kernel (`norm_rope`, launched directly in eager calls like `rotary`)."""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.distributed.distributed_c10d import _resolve_process_group

from ...kernels import triton_runs_on
from ...kernels.rotary_args import JointTokens, NormedTokens, NormRope
from ...logging_utils import warn_once
from ...runtime.distributed import waiting_for
from .backends import FALLBACK, Backend, LocalAttention, get_backend, get_choice
from .exchange import all_to_all
from ..fabric import fabric_of
from .layout import UlyssesLayout
from .local import diffusers_attention, sdpa_bshd
from .reference import serial_exchange
from ..sharding import SequenceShard


@torch.library.custom_op("xstage::ulysses_attention", mutates_args=())
def ulysses_attention(
    query_parts: list[torch.Tensor],
    key_parts: list[torch.Tensor],
    value_parts: list[torch.Tensor],
    norm_weights: list[torch.Tensor],
    norm_eps: list[float],
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    norm_across_heads: bool,
    text_mask: torch.Tensor | None,
    text_len: int,
    seq_len: int,
    local_len: int,
    degree: int,
    rank: int,
    text_first: bool,
    text_queries: bool,
    backend: str,
    group_name: str,
    scale: float | None,
    attention_backend: str | None,
    pair_bias: bool = False,
) -> torch.Tensor:
    """q, k and v each come as the parts (1 or 2 tensors (B, rows, H, D)) their joint tokens join; where `cos` is
    given, q's and k's parts are also normalised part by part (the weights and epsilons of q's parts, then of k's;
    per head vector, or `norm_across_heads` over a token's whole vector) and the joined tokens rotated by
    (cos, sin): a processor's prologue (JointTokens, NormRope), which a
    backend with a joint entry (the fused one) applies in its stores and any other gets applied first (the norm +
    RoPE kernel, a concatenation). The layout travels as its fields (a custom op's arguments are tensors and
    scalars); `backend` names the choice (sp/attention/backends.py) that picks the backend for this call;
    `attention_backend`, the diffusers attention backend the user chose for the model, if any; `pair_bias`:
    `text_mask` is the text tokens' factor of a pair bias (masks.QueryKeyMasks.PAIR_BIAS), which only the
    reference backend attends with."""
    layout = UlyssesLayout(text_len, seq_len, local_len, degree, rank, text_first, text_queries)
    split = len(query_parts)
    query, key = (JointTokens(tuple(parts), None if cos is None else NormRope(tuple(weights), tuple(eps), cos, sin,
                                                                               norm_across_heads))
                  for parts, weights, eps in ((query_parts, norm_weights[:split], norm_eps[:split]),
                                              (key_parts, norm_weights[split:], norm_eps[split:])))
    value = JointTokens(tuple(value_parts))
    chosen = get_choice(backend).pick(query_parts[0], layout, fabric_ready=fabric_of(group_name) is not None)
    group = _resolve_process_group(group_name)
    if pair_bias:
        say_pair_bias_fallback(chosen.name)
        return serial_exchange(_joined(query), _joined(key), _joined(value), layout, all_to_all(group), scale,
                               text_mask, gathered_attention(get_backend(FALLBACK), attention_backend),
                               text_factor=True)
    if chosen.joint is not None:
        out = chosen.joint(query, key, value, layout, group, scale, text_mask)
    else:
        out = chosen.ulysses(_joined(query), _joined(key), _joined(value), layout, group, scale, text_mask,
                             gathered_attention(chosen, attention_backend))
    # a custom op owns its output: a symmetric backend's is a reused fabric buffer
    return out.clone() if chosen.symmetric else out


@ulysses_attention.register_fake
def _(query_parts, key_parts, value_parts, norm_weights, norm_eps, cos, sin, norm_across_heads, text_mask, text_len,
      seq_len, local_len, degree, rank, text_first, text_queries, backend, group_name, scale, attention_backend,
      pair_bias=False):
    batch, _, heads, head_dim = query_parts[0].shape
    return query_parts[0].new_empty(batch, sum(part.shape[1] for part in query_parts), heads, head_dim)


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


@torch.library.custom_op("xstage::gathered_keys_attention", mutates_args=())
def gathered_keys_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seq_len: int, degree: int,
                            rank: int, group_name: str, scale: float | None,
                            attention_backend: str | None) -> torch.Tensor:
    """Whole (replicated) queries over keys and values split with the tokens, (B, L, H, D) per rank: every rank's
    keys and values are all-gathered (padding dropped, `seq_len` tokens) and attended here; every rank computes
    the same output."""
    shard = SequenceShard(degree, rank, _resolve_process_group(group_name))
    shard.seq_len = seq_len
    with waiting_for(lambda: "the other ranks' keys and values for an attention over all their tokens"):
        key, value = shard.gather(torch.stack([key, value]), 2).unbind(0)  # one collective for both
    attend = sdpa_bshd if attention_backend is None else diffusers_attention(attention_backend)
    return attend(query, key, value, None, scale)


@gathered_keys_attention.register_fake
def _(query, key, value, seq_len, degree, rank, group_name, scale, attention_backend):
    return torch.empty_like(query)


def say_pair_bias_fallback(backend: str) -> None:
    """Pair-bias masks (masks.QueryKeyMasks.PAIR_BIAS) run on the reference backend: say once that `backend`
    falls back to it (not while a graph is traced: the compiler cannot trace logging)."""
    if backend != FALLBACK and not torch.compiler.is_compiling():
        warn_once(f"xstage_dit backend {backend!r} does not take pair-bias attention masks (Chroma's); running "
                  f"{FALLBACK!r}")


def gathered_attention(chosen: Backend, attention_backend: str | None) -> LocalAttention:
    """What a backend attends the gathered heads with: the user's diffusers attention backend where one was
    chosen (a backend with its own kernel says once that it replaces it), else SDPA."""
    if attention_backend is None:
        return sdpa_bshd
    if chosen.own_attention:
        warn_once(f"xstage_dit backend {chosen.name!r} attends with its own kernel, in place of the attention "
                  f"backend {attention_backend!r} set on the model")
    return diffusers_attention(attention_backend)


def local_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                    backend: str, scale: float | None) -> torch.Tensor:
    """Degree 1: attention of the whole sequence by the kernel of the backend that choice `backend` picks (a
    model with an attention backend of the user's runs that instead: UlyssesAttention)."""
    chosen = get_choice(backend).pick(query, None, fabric_ready=True)
    return chosen.local(query, key, value, attn_mask, scale)


@torch.library.custom_op("xstage::local_attention", mutates_args=())
def local_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                       backend: str, scale: float | None) -> torch.Tensor:
    out = local_attention(query, key, value, attn_mask, backend, scale)
    like = torch.empty_like(query)
    if out.stride() == like.stride():
        return out
    # the compiled graph was promised query's layout (the fake below); SDPA returns its own
    return like.copy_(out)


@local_attention_op.register_fake
def _(query, key, value, attn_mask, backend, scale):
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
        return rotary_emb(x, cos, sin, sequence_dim)
    return _rotary.rotate(x, cos, sin, sequence_dim)


@torch.library.custom_op("xstage::rotary_emb", mutates_args=())
def rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sequence_dim: int) -> torch.Tensor:
    return _rotary.rotary_interleaved(x, cos, sin, sequence_dim)


@rotary_emb.register_fake
def _(x, cos, sin, sequence_dim):
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
    first, second = parts[0], parts[-1]
    return norm_rope_op(first.tokens, first.weight, first.eps, second.tokens if len(parts) == 2 else None,
                        second.weight, second.eps, cos, sin)


@torch.library.custom_op("xstage::norm_rope", mutates_args=())
def norm_rope_op(first: torch.Tensor, first_weight: torch.Tensor, first_eps: float, second: torch.Tensor | None,
                 second_weight: torch.Tensor, second_eps: float, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
    parts = [NormedTokens(first, first_weight, first_eps)]
    if second is not None:
        parts.append(NormedTokens(second, second_weight, second_eps))
    return _rotary.norm_rotate(parts, cos, sin)


@norm_rope_op.register_fake
def _(first, first_weight, first_eps, second, second_weight, second_eps, cos, sin):
    return first.new_empty(first.shape[0], cos.shape[0], *first.shape[2:])
