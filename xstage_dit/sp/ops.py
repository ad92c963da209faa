"""Ulysses attention as a `torch.library` custom op, so that a patched transformer compiles (e.g. diffusers'
`compile_repeated_blocks`) with the attention and its communication as one opaque node: no graph break, and
the compiler never traces collectives or symmetric-memory kernels."""
from __future__ import annotations

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from ..runtime.symmetric import SymmetricPool
from .auto import choose
from .backends import UlyssesLayout, get_backend


@torch.library.custom_op("xstage::ulysses_attention", mutates_args=())
def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    text_mask: torch.Tensor | None,
    text_len: int,
    seq_len: int,
    local_len: int,
    degree: int,
    rank: int,
    text_first: bool,
    backend: str,
    group_name: str,
    scale: float | None,
) -> torch.Tensor:
    layout = UlyssesLayout(text_len, seq_len, local_len, degree, rank, text_first)
    if backend == "auto":
        backend = choose(query, layout, pool_ready=SymmetricPool.exists(group_name))
    chosen = get_backend(backend)
    out = chosen.ulysses(query, key, value, layout, _resolve_process_group(group_name), scale, text_mask)
    # a custom op owns its output: a symmetric backend's is a reused pooled buffer
    return out.clone() if chosen.symmetric else out


@ulysses_attention.register_fake
def _(query, key, value, text_mask, text_len, seq_len, local_len, degree, rank, text_first, backend, group_name,
      scale):
    return torch.empty_like(query)
