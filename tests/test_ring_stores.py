"""The X-Stage ring (sp/attention/ring.py `stored_ring_steps`): N simulated ring ranks over a LoopbackFabric,
their key blocks forwarded by the attention kernel's stores, against one attention over every key (float32 on CPU in
Triton's interpreter: < 1e-4; bf16 on a GPU against float32: < 2e-2; FP8 attention within its bound,
numerics.FP8_ATTENTION_ERROR)."""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_on_ranks
from gpu_checks import same_gpu_worker
from numerics import FP8_ATTENTION_ERROR
from xstage_dit.sp.attention.layout import UlyssesLayout
from xstage_dit.sp.attention.ring import attention_with_lse, stored_ring_steps
from xstage_dit.sp.attention.masks import pair_bias, with_image_keys
from xstage_dit.sp.fabric import LoopbackFabric, run_in_lockstep


def _check_stored_ring(device: str, dtype: torch.dtype, degree: int, seq_len: int, text_len: int, heads: int,
                       kv_heads: int, tolerance: float, batch: int = 2, head_dim: int = 64,
                       text_factor: bool = False, fp8: bool = False) -> None:
    """`text_factor`: the text mask is a pair bias's 0/1 factor (Chroma's), else a key-padding mask; `fp8`: every
    partial attention in FP8."""
    block = -(-seq_len // degree)  # each rank's block, the sequence tail-padded
    gen = torch.Generator().manual_seed(degree * 100 + seq_len)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    q_text, q_image = randn(batch, text_len, heads, head_dim), randn(batch, degree * block, heads, head_dim)
    k_text, k_image = randn(batch, text_len, kv_heads, head_dim), randn(batch, degree * block, kv_heads, head_dim)
    v_text, v_image = randn(batch, text_len, kv_heads, head_dim), randn(batch, degree * block, kv_heads, head_dim)
    text_mask = None
    if text_len:
        text_mask = torch.ones(batch, 1, 1, text_len, dtype=torch.bool, device=device)
        text_mask[1, ..., text_len // 2:] = False
        if text_factor:
            text_mask = text_mask.float()
    fabric = LoopbackFabric(degree, device, initialise=lambda t: t.fill_(float("nan")))
    ranks, expected = [], []
    for rank in range(degree):
        layout = UlyssesLayout(text_len=text_len, seq_len=seq_len, local_len=block, degree=1, rank=0,
                               text_first=True, text_queries=True, ring_degree=degree, ring_rank=rank)
        rows = slice(rank * block, (rank + 1) * block)
        q, k, v = (torch.cat([text, image[:, rows]], dim=1).to(dtype)
                   for text, image in ((q_text, q_image), (k_text, k_image), (v_text, v_image)))
        ranks.append(stored_ring_steps(q, k, v, layout, fabric.rank(rank), None, text_mask, text_factor, fp8=fp8))
        every_key = slice(0, text_len + seq_len)
        keys, values = (torch.cat([text, image], dim=1)[:, every_key] for text, image in
                        ((k_text, k_image), (v_text, v_image)))
        queries = torch.cat([q_text, q_image[:, rows]], dim=1)
        mask = (pair_bias(text_mask, layout, queries.shape[1], text_len + seq_len) if text_factor
                else with_image_keys(text_mask, seq_len))
        expected.append(attention_with_lse(queries, keys, values, mask, None)[0])
    outputs = run_in_lockstep(ranks, lambda what: None)
    for rank, (out, want) in enumerate(zip(outputs, expected)):
        true_rows = text_len + max(0, min(block, seq_len - rank * block))
        got, want = out[:, :true_rows].float(), want[:, :true_rows]
        error = ((got - want).norm() / want.norm()).item()
        assert error < tolerance, f"ring rank {rank}: relative error {error:.2e}"


@pytest.mark.parametrize("degree, seq_len, text_len, text_factor", [(3, 19, 0, False), (4, 10, 4, False),
                                                                    (3, 17, 6, True)])
def test_stored_ring_equals_one_attention_interpreted(degree, seq_len, text_len, text_factor):
    """Uneven blocks (19 over 3; 10 over 4 leaves the last block empty), text with a padding mask, a pair bias's
    factor (Chroma's) or none, grouped keys (4 query heads over 2 key heads)."""
    _check_stored_ring("cpu", torch.float32, degree, seq_len, text_len, heads=4, kv_heads=2, tolerance=1e-4,
                       text_factor=text_factor)


@pytest.mark.parametrize("degree, seq_len, text_len", [(3, 19, 0), (4, 10, 4)])
def test_stored_ring_in_fp8_interpreted(degree, seq_len, text_len):
    """FP8 attention's forward and merge epilogues around the ring: each block quantized (and its keys smoothed)
    on its own, the steps merged by their float32 log-sum-exps."""
    _check_stored_ring("cpu", torch.float32, degree, seq_len, text_len, heads=4, kv_heads=2,
                       tolerance=FP8_ATTENTION_ERROR, fp8=True)


@pytest.mark.gpu
@pytest.mark.parametrize("degree, seq_len, text_len", [(2, 4096, 77), (4, 3001, 0), (8, 8190, 512)])
def test_stored_ring_equals_one_attention_on_gpu(degree, seq_len, text_len):
    _check_stored_ring("cuda", torch.bfloat16, degree, seq_len, text_len, heads=8, kv_heads=8, tolerance=2e-2,
                       head_dim=128)


@pytest.mark.gpu
@pytest.mark.parametrize("degree, seq_len, text_len", [(2, 4096, 77), (8, 8190, 512)])
def test_stored_ring_in_fp8_on_gpu(degree, seq_len, text_len):
    _check_stored_ring("cuda", torch.bfloat16, degree, seq_len, text_len, heads=8, kv_heads=2,
                       tolerance=FP8_ATTENTION_ERROR, head_dim=128, fp8=True)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_ring_of_processes_sharing_one_gpu_matches_one_gpu(backend):
    """Ulysses 2 x ring 2 on 4 processes of one GPU: "fused" opens the ring group's fabric (its blocks by the
    attention kernel's stores), "reference" sends them point to point; bf16 against one GPU."""
    run_on_ranks(4, same_gpu_worker, "tiny-flux-d64", backend, None, None, {"ulysses_degree": 2, "ring_degree": 2},
                 deadline_s=300)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_log_sum_exp_of_every_gpu_path_agrees(dtype):
    """Unmasked half-precision blocks attend with cuDNN, masked ones with the efficient kernel: both give the same
    output and log-sum-exp as float32 math (the merge of a ring's steps needs both)."""
    q, k, v = (torch.randn(2, 300, 4, 128, device="cuda") for _ in range(3))
    want_out, want_lse = attention_with_lse(q, k, v, None, None)  # float32: the efficient kernel
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 128 ** 0.5
    assert torch.allclose(want_lse, scores.logsumexp(-1), atol=1e-4)
    out, lse = attention_with_lse(q.to(dtype), k.to(dtype), v.to(dtype), None, None)
    assert ((out.float() - want_out).norm() / want_out.norm()).item() < 1e-2
    assert torch.allclose(lse, want_lse, atol=2e-2)
    masked_out, masked_lse = attention_with_lse(q.to(dtype), k.to(dtype), v.to(dtype),
                                                torch.ones(2, 1, 1, 300, dtype=torch.bool, device="cuda"), None)
    assert torch.allclose(masked_lse, want_lse, atol=2e-2)
