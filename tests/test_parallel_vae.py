"""The row-split VAE decode equals one process's decode (float32, CPU, real gloo processes): every supported
VAE, batch 2, latent heights that split unevenly; `disable` restores the decode exactly; calls the split cannot
take run whole with one warning."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import xstage_dit
from xstage_dit.testing import zoo
from dist_harness import run_on_ranks, share_one_gpu, xstage_warnings
from numerics import relative_error
from vae_checks import rows_seen
from xstage_dit.patches.vaes import vae_rule_for
from xstage_dit.vae.decode import ParallelDecode

TOLERANCE = 1e-4
TINY = ["tiny-kl", "tiny-wan2.1", "tiny-wan2.2", "tiny-qwenimage", "tiny-hunyuan-video", "tiny-ltx"]


def _decode_worker(names: list[str], sizes: list[int], device: str = "cpu",
                   dtype: torch.dtype = torch.float32) -> None:
    """For each group size, the first `size` ranks decode split over a group of their own (one spawn covers
    every size). On the CPU (float32) the split decode is within TOLERANCE of the unsplit one. In half precision
    both are compared with a float32 decode of the same weights: the split one may be off by at most twice as
    much as the unsplit one (its convolutions and reductions run on other shapes, so they round differently)."""
    if device == "cuda":
        share_one_gpu()
        torch.backends.cudnn.allow_tf32 = False  # float32 means float32 here (Wan's VAE)
    dist.init_process_group("gloo")
    groups = {size: dist.new_group(list(range(size))) for size in sizes}  # every rank creates every group
    for name in names:
        vae = zoo.build_vae(name, device, dtype)
        z = zoo.vae_latent(name, device, next(vae.parameters()).dtype)
        seen = rows_seen(vae)
        with torch.no_grad():
            ref = vae.decode(z, return_dict=False)[0]
            exact = ref if ref.dtype == torch.float32 else \
                copy.deepcopy(vae).float().decode(z.float(), return_dict=False)[0]
        bound = TOLERANCE if ref.dtype == torch.float32 else 2 * relative_error(ref.float(), exact)
        rule = vae_rule_for(vae)
        for size, group in groups.items():
            rank = dist.get_rank()
            if rank >= size:
                continue
            with torch.no_grad():
                split = ParallelDecode(vae, rule.layers(vae), group, rule.replicated_because)
                seen.clear()
                out = vae.decode(z, return_dict=False)[0]
                split_rows = set(seen)
                split.remove()
                restored = vae.decode(z, return_dict=False)[0]
            error = relative_error(out.float(), exact)
            assert error < bound, f"{name} over {size} ranks on {device}: relative error {error:.2e} < {bound:.2e}"
            height = z.shape[-2]
            share = height // size + (rank < height % size)
            assert split_rows == {share}, f"{name}: rank {rank}'s decoder saw {split_rows} of {height} rows"
            assert torch.equal(restored, ref), f"{name}: remove() did not restore the decode"


def test_row_split_decode_matches_one_process() -> None:
    """Every tiny VAE, batch 2, 7 latent rows (uneven over 2, 3 and 4 ranks)."""
    run_on_ranks(4, _decode_worker, TINY, [2, 3, 4])


@pytest.mark.gpu
def test_row_split_decode_on_gpu_matches_one_process() -> None:
    """bf16 (Wan's VAE in float32, as diffusers keeps it), 2 processes sharing one GPU."""
    run_on_ranks(2, _decode_worker, TINY, [2], "cuda", torch.bfloat16)


def _pipeline_worker() -> None:
    with xstage_warnings() as warnings:
        for name, size in (("tiny-flux", {"height": 20, "width": 28, "num_frames": 1}),
                           ("tiny-wan", {"height": 16, "width": 112, "num_frames": 17})):
            pipe = zoo.build_pipeline(name)
            pipe.set_progress_bar_config(disable=True)

            def generate() -> torch.Tensor:
                kwargs = zoo.call_kwargs(name, **size, steps=1, guidance=1.0)
                return pipe(**kwargs, **zoo.text_embeddings(name, 2, seed=2), output_type="pt",
                            generator=torch.Generator().manual_seed(7), return_dict=False)[0]

            seen = rows_seen(pipe.vae)
            stock = generate()
            stock_rows = max(seen)
            xstage_dit.enable(pipe, backend="reference", timeout_s=120)
            seen.clear()
            out = generate()
            share = stock_rows // 2 + (dist.get_rank() < stock_rows % 2)
            assert set(seen) == {share}, f"{name}: the decoder saw {seen} of {stock_rows} latent rows"
            error = relative_error(out, stock)
            assert error < TOLERANCE, f"{name}: relative error {error:.2e}"

            pipe.vae.enable_tiling()  # tiles are chosen on the whole latent: the decode runs whole, saying so once
            seen.clear()
            tiled = generate()
            pipe.vae.disable_tiling()
            assert max(seen) == stock_rows and relative_error(tiled, stock) < TOLERANCE
            vae_class = type(pipe.vae).__name__
            assert sum(f"{vae_class} decode" in m and "tiling is on" in m for m in warnings) == 1, warnings

            xstage_dit.disable(pipe)
            assert torch.equal(generate(), stock), f"{name}: disable did not restore the pipeline"


def test_enabled_pipeline_decodes_split_and_equal() -> None:
    run_on_ranks(2, _pipeline_worker)
