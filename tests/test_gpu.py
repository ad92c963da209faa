"""GPU checks (marked `gpu`, skipped without CUDA; run on the device machine with .ci/device.sh).

bf16 tolerances: SDPA in bf16 against a float32 reference lands near 1e-3..1e-2 relative; a pipeline whose
attention kernel changes (cuDNN here, whatever SDPA picks in stock diffusers) drifts a little more over steps."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import xstage_dit
from dist_harness import run_on_ranks
from xstage_dit import zoo
from xstage_dit.sp.local_attention import sdpa_bshd

pytestmark = pytest.mark.gpu
ATTENTION_TOLERANCE = 1e-2
PIPELINE_TOLERANCE = 3e-2


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("q_len, kv_len, heads, head_dim", [(4096, 4096, 24, 128), (1000, 777, 5, 64)])
def test_best_sdpa_matches_float32(q_len, kv_len, heads, head_dim):
    q = torch.randn(1, q_len, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, kv_len, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, kv_len, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    ref = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / head_dim**0.5, dim=-1)
    ref = torch.einsum("bhqk,bkhd->bqhd", ref, v.double())
    assert _relative_error(sdpa_bshd(q, k, v), ref) < ATTENTION_TOLERANCE


def _generate(pipe, name: str, size: dict, batch: int = 1) -> torch.Tensor:
    kwargs = zoo.call_kwargs(name, **size, steps=2, guidance=3.0)
    embeddings = zoo.text_embeddings(name, batch, seed=1, device="cuda", dtype=torch.bfloat16)
    return pipe(**kwargs, **embeddings, output_type="latent", generator=torch.Generator().manual_seed(5),
                return_dict=False)[0]


SIZES = {"tiny-flux": {"height": 20, "width": 28, "num_frames": 1},
         "tiny-wan": {"height": 16, "width": 112, "num_frames": 17}}


@pytest.mark.parametrize("name", ["tiny-flux", "tiny-wan"])
def test_degree_one_on_gpu_matches_stock(name):
    pipe = zoo.build_pipeline(name, device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    stock = _generate(pipe, name, SIZES[name])
    xstage_dit.enable(pipe)
    try:
        assert _relative_error(_generate(pipe, name, SIZES[name]), stock) < PIPELINE_TOLERANCE
    finally:
        xstage_dit.disable(pipe)


def _same_gpu_worker(name: str) -> None:
    # NCCL refuses two ranks on one GPU; gloo moves CUDA tensors through the host, enough for correctness
    dist.init_process_group("gloo")
    pipe = zoo.build_pipeline(name, device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    stock = _generate(pipe, name, SIZES[name], batch=2)
    xstage_dit.enable(pipe, timeout_s=120)
    error = _relative_error(_generate(pipe, name, SIZES[name], batch=2), stock)
    assert error < PIPELINE_TOLERANCE, f"{name}, 2 ranks on one GPU: relative error {error:.2e}"


@pytest.mark.parametrize("name", ["tiny-flux", "tiny-wan"])
def test_two_ranks_on_one_gpu_match_single_process(name):
    run_on_ranks(2, _same_gpu_worker, name)
