"""The csrc/ probes and `xstage-dit calibrate` on a GPU (marked `gpu` and `calibration`: they take minutes and
need the built xstage_dit._C)."""
from __future__ import annotations

import statistics

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.calibration]
MiB = 2**20


@pytest.fixture(scope="module")
def probe():
    from xstage_dit.probing.probes import BurstProbe

    return BurstProbe(torch.device("cuda", 0))


def test_clock_rate_is_an_sm_clock(probe):
    assert 0.5e9 < probe.cycles_per_second < 3.5e9


def test_trains_report_issue_times_gaps_and_visibility(probe):
    destination = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    volume = 4 * MiB
    train = probe.train(destination, 16, volume, 12, gap=10e-6)
    assert len(train.issue_times) == 12 and all(t > 0 for t in train.issue_times)
    assert train.steady_gap() >= 9e-6  # the spin, plus waiting for the other producers
    # a burst cannot be issued faster than the whole GPU writes memory (~5 TB/s on an H200)
    assert volume / train.steady_issue_time() < 10e12
    issued = statistics.median(probe.train(destination, 16, volume, 1, 0.0).issue_times[0] for _ in range(5))
    landed = statistics.median(probe.train(destination, 16, volume, 1, 0.0, fence=True).issue_times[0]
                               for _ in range(5))
    assert landed >= 0.9 * issued
    assert destination.view(torch.int32)[3].item() == 0x5EED  # the stores landed where asked


def test_producers_that_cannot_all_run_time_out_with_a_message(probe, monkeypatch):
    monkeypatch.setattr(type(probe), "TIMEOUT_S", 0.2)
    destination = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    too_many = 16 * torch.cuda.get_device_properties(0).multi_processor_count  # more CTAs than can be resident
    with pytest.raises(RuntimeError, match="did not all arrive"):
        probe.train(destination, too_many, 16 * too_many * 64, 2, 0.0)


def test_calibrate_writes_fits_and_info_lists_them(tmp_path, monkeypatch, capsys):
    from xstage_dit.cli import main
    from xstage_dit.sp.attention.backends import backends, costs_of
    from xstage_dit.burst_gap import AttentionShape, Calibration, Planner

    monkeypatch.setenv("XSTAGE_CALIBRATION_DIR", str(tmp_path))
    main(["calibrate", "--quick"])
    calibrations = [Calibration.load(p) for p in sorted(tmp_path.glob("calibration-*.json"))]
    peers = "same-gpu" if torch.cuda.device_count() == 1 else "nvlink"
    assert {c.topology for c in calibrations} <= {"loopback", peers, "pcie"} and len(calibrations) == 2
    for calibration in calibrations:
        assert calibration.fit_error["median"] < 0.3, calibration.fit_error
        shape = AttentionShape(1, 16384, 0, 24, 128, 8)
        predicted = Planner.from_calibration(calibration).predict(shape, costs_of(backends()))
        assert all(0 < t < 1 for t in predicted.values()), predicted
    main(["info"])
    assert "loopback" in capsys.readouterr().out


def test_kernels_only_remeasures_costs_and_keeps_the_fit(tmp_path):
    from xstage_dit.cli import main
    from xstage_dit.burst_gap import BurstGapModel, Calibration, KernelCosts

    model = BurstGapModel(issue_latency=1e-6, producer_rate=10e9, max_issue_rate=1e12, drain_rate=300e9,
                          capacity=2 * MiB)
    stale = KernelCosts({128: [(4096, 1.0)]}, {128: [(4096, 1.0)]}, 1e9, 123e9, 1e-6, 1)
    fit = {"median": 0.01, "max": 0.05, "samples": 3}
    old = Calibration(torch.cuda.get_device_name(), "nvlink", 2, model, stale, fit).save(tmp_path / "in")
    main(["calibrate", "--kernels-only", str(old), "--out", str(tmp_path / "out")])
    new = Calibration.load(tmp_path / "out" / old.name)
    assert new.model == model and new.costs.alltoall_rate == 123e9, "the fit and the all-to-all rate are kept"
    assert set(new.costs.own_tflops) == {64, 128} and new.costs.own_tflops[128][0][1] > 100
    assert new.costs.sms == torch.cuda.get_device_properties(0).multi_processor_count
    assert "kernel_costs" in new.meta
