"""examples/bench_e2e.py's error pass (--errors, --decode), the path the FP8 quality tables come from, on CPU."""
from __future__ import annotations

import pytest

import bench_e2e
from xstage_dit.testing import zoo

pytestmark = pytest.mark.cpu_paths


# Z-Image's transformer returns one tensor per batch item, the others one tensor
@pytest.mark.parametrize("name", ["tiny-flux", "tiny-zimage"])
def test_the_error_pass_measures_each_variant_against_stock_eager(name: str) -> None:
    """In float32 on one process our reference backend is stock diffusers' result to rounding: its errors are
    near zero and its decoded PSNR far above any low-precision mode's."""
    entry = zoo.ZOO[name]
    pipe = zoo.build_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    call = zoo.call_kwargs(name, height=entry.height, width=entry.width, num_frames=entry.num_frames, steps=2,
                           guidance=1.0)
    call.update(zoo.text_embeddings(name, 1, seed=0))
    errors = bench_e2e.output_errors(pipe, ["stock", "xstage-reference"], call, decode=True)
    assert errors["stock"] == bench_e2e.Errors(0.0, 0.0, float("inf"))
    ours = errors["xstage-reference"]
    assert ours.first_forward < 1e-5 and ours.final_latents < 1e-5, ours
    assert ours.psnr_db > 80, ours


def test_a_variant_that_falls_back_says_so_in_its_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny FLUX.1's head_dim 16 is not one the FP8 attention kernel takes: the FP8 variant runs bf16 attention,
    and its record carries the warning that says so (the interpreter stands in for a GPU)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pipe = zoo.build_pipeline("tiny-flux")
    pipe.set_progress_bar_config(disable=True)
    call = zoo.call_kwargs("tiny-flux", height=32, width=48, num_frames=1, steps=1, guidance=1.0)
    call.update(zoo.text_embeddings("tiny-flux", 1, seed=0))
    for _ in range(2):  # a warning said once a process is said again for the variant's next call
        bench_e2e.SAID.clear()
        with bench_e2e.variant_of(pipe, "xstage-auto+fp8-attention"):
            pipe(**call, output_type="latent")
        said = bench_e2e.SAID["xstage-auto+fp8-attention"]
        assert any("does not take head_dim 16" in message for message in said), said
