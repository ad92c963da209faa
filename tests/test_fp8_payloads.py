"""FP8 payloads (XStageConfig.fp8 "payloads", kernels/fp8.py): the quantization every store kernel runs, what the
planner and `enable` make of the knob, and where a call cannot send FP8 payloads. The fused exchange with FP8
payloads over N simulated ranks is test_kernels.py's loopback check (`fp8_payloads=True`)."""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_on_ranks, xstage_warnings
from numerics import fp8_error_bound, fp8_round_trip
from pipeline_checks import pipeline_worker
from xstage_dit.burst_gap import Planner, find_calibration
from xstage_dit.burst_gap.calibration import SHIPPED, SHIPPED_GPU
from xstage_dit.burst_gap.ulysses_plan import AttentionShape
from xstage_dit.precision.steps import StepPrecision
from xstage_dit.sizes import fp8_payload_bytes

pytest.importorskip("triton", reason="triton is not installed: the fused extra (CUDA builds of torch bring it)")
from xstage_dit.kernels.fp8 import PAYLOAD_DTYPE, SCALE_DTYPE, dequantize, quantize  # noqa: E402


def _rows_of_every_magnitude(generator: torch.Generator) -> torch.Tensor:
    """(B, S, H, 64) rows from 1e-30 to 1e30, with rows of zeros, signed zeros, and rows whose values span e4m3's
    whole range (so that most of them are subnormal once the row is scaled)."""
    x = torch.randn(2, 40, 3, 64, generator=generator) * torch.logspace(-30, 30, 40)[None, :, None, None]
    x[0, 0] = 0.0
    x[0, 1] = -0.0
    x[1, 2] *= torch.logspace(-12, 0, 64)
    return x


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.smoke])])
def test_payloads_round_to_nearest_on_e4m3s_grid_within_the_stated_bound(device: str):
    """The kernels' payload bytes are torch's own e4m3 rounding of each row scaled to amax 448: the interpreter's
    float32 rounding on CPU, the GPU's conversion instruction on a GPU. The scales are amax / 448 (a floor for rows
    of zeros); dequantized, every value is within 2^-4 of itself or 2^-10 of its row's scale
    (numerics.fp8_error_bound), rows of zeros exactly zero."""
    x = _rows_of_every_magnitude(torch.Generator().manual_seed(0)).to(device)
    payload = torch.empty(x.shape, dtype=PAYLOAD_DTYPE)
    scales = torch.empty(x.shape[:-1], dtype=SCALE_DTYPE)
    quantize(x, payload, scales)
    amax = x.abs().amax(-1).clamp_min(1e-30)
    expected = (x * (448 / amax)[..., None]).to(PAYLOAD_DTYPE)
    assert torch.equal(payload.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(scales, amax / 448)
    values = dequantize(payload, scales, torch.float32)
    assert ((values.double() - x).abs() <= fp8_error_bound(x)).all()
    assert not values[0, :2].any()


def test_a_payload_of_the_wrong_kind_is_refused_in_words():
    payload = torch.empty(2, 3, 64, dtype=PAYLOAD_DTYPE)
    with pytest.raises(ValueError, match=r"an FP8 payload is a contiguous torch.float8_e4m3fn \(..., D\) tensor"):
        dequantize(payload, torch.empty(2, 4), torch.float32)
    with pytest.raises(ValueError, match=r"an FP8 payload is a contiguous"):
        dequantize(payload.to(torch.float32), torch.empty(2, 3), torch.float32)


def test_the_round_trip_costs_what_the_bound_says_on_random_rows_interpreted():
    """On standard normal rows of head_dim 128, the round trip's normwise error is about 2.5 % (the per-element
    bound is 6.25 %): what docs/usage.md states."""
    x = torch.randn(4, 256, 2, 128, generator=torch.Generator().manual_seed(1))
    error = ((fp8_round_trip(x) - x).norm() / x.norm()).item()
    assert 0.015 < error < 0.035, error


def test_the_planner_prices_fp8_payloads_at_half_the_bytes():
    """The fused path's stores send e4m3 bytes plus a float32 scale per row of head_dim (sizes.fp8_payload_bytes):
    on the shipped H200 calibration its pre-all-to-all and its epilogue's stores cost less, the other strategies
    (which send the model's dtype) the same."""
    planner = Planner.from_calibration(find_calibration(SHIPPED_GPU, 8, directory=SHIPPED)).ulysses
    plain = AttentionShape(1, 65536, 512, 24, 128, 8)
    fp8 = AttentionShape(1, 65536, 512, 24, 128, 8, payload_bytes=fp8_payload_bytes(128))
    assert fp8.payload_ratio == pytest.approx((1 + 4 / 128) / 2)
    assert planner.pre_all_to_all(fp8) < planner.pre_all_to_all(plain)
    assert planner.serial_call(fp8) == planner.serial_call(plain)
    assert planner.overlap_call(fp8) == planner.overlap_call(plain)


def test_the_plan_command_prices_fp8_payloads(capsys):
    from xstage_dit.cli import main

    main(["plan", "--tokens", "65536", "--heads", "24", "--ranks", "8", "--fp8", "payloads"])
    assert "payload_bytes=1.03125" in capsys.readouterr().out


def test_payloads_and_attention_follow_the_step_precision(monkeypatch):
    """The router asks the op for FP8 payloads only while the model's step runs payloads in FP8, as it attends with
    the FP8 variant only while the step runs attention in FP8 (precision/steps.py: the full-precision steps run
    neither)."""
    from xstage_dit.runtime.distributed import Axis
    from xstage_dit.sp.attention import ulysses as router
    from xstage_dit.sp.attention.backends import get_choice
    from xstage_dit.sp.sharding import SequenceShard

    asked = []
    monkeypatch.setattr(router, "ulysses_attention",
                        lambda *args, backend, fp8_payloads, **kwargs: asked.append((backend, fp8_payloads)))
    shard = SequenceShard(2, 0, None)
    shard.seq_len = 16
    precision = StepPrecision(("attention", "payloads"))
    fused = get_choice("fused")
    attention = router.UlyssesAttention(shard, fused, ulysses=Axis(2, 0, None), precision=precision,
                                        fp8_choice=fused.fp8)
    q = torch.randn(1, 8, 2, 64)
    for full_precision_now in (False, True, False):
        precision.full_precision_now = full_precision_now
        attention(q, q, q)
    assert asked == [("fused+fp8", True), ("fused", False), ("fused+fp8", True)]
    payloads_only = router.UlyssesAttention(shard, fused, ulysses=Axis(2, 0, None),
                                            precision=StepPrecision(("payloads",)))
    payloads_only(q, q, q)
    assert asked[-1] == ("fused", True)


def _fp8_payloads_on_cpu_ranks_worker() -> None:
    with xstage_warnings() as said:
        pipeline_worker("tiny-flux", 1, 3.0, "auto", False, None, {"fp8": "payloads"})
    assert [w for w in said if "fp8 payloads" in w] == [
        "xstage_dit: fp8 payloads: backend 'reference' sends none; such calls send torch.float32"], said


def test_enable_takes_fp8_payloads_and_a_call_that_cannot_send_them_says_so_once():
    """Accepted with backend="auto"; on CPU ranks the fused backend cannot run (symmetric memory is GPU-only), so
    auto runs the reference strategy, whose all-to-alls send the model's dtype: the result is the one process's,
    and that is said once."""
    run_on_ranks(2, _fp8_payloads_on_cpu_ranks_worker)


# tiny-flux-d64's two bf16 steps on two ranks sharing a GPU, FP8 payloads against the stock pipeline
FP8_PIPELINE_TOLERANCE = 6e-2


def _fp8_payloads_on_one_gpu_worker() -> None:
    from gpu_checks import same_gpu_worker
    from xstage_dit.sp.attention import fused

    dequantized = []
    dequantize_payload = fused.dequantize

    def counted(*args: object) -> torch.Tensor:
        dequantized.append(1)
        return dequantize_payload(*args)

    fused.dequantize = counted
    with xstage_warnings() as said:
        same_gpu_worker("tiny-flux-d64", "fused", fp8="payloads", tolerance=FP8_PIPELINE_TOLERANCE)
    assert dequantized, "no attention call sent FP8 payloads"
    assert not [w for w in said if "fp8 payloads" in w], said


@pytest.mark.gpu
def test_fp8_payloads_on_ranks_sharing_one_gpu_match_single_process():
    """The fused backend's exchanges in FP8 on two processes sharing a GPU (symmetric memory): every routed call
    sends FP8 payloads, none says it could not, and the latents stay within FP8_PIPELINE_TOLERANCE of the stock
    pipeline's."""
    run_on_ranks(2, _fp8_payloads_on_one_gpu_worker, deadline_s=150)
