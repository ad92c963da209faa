"""The planner and calibrations on CPU: predictions follow the model's regimes, the tile-order knob, the MoE modes
and schedules, JSON keys and lookup, backend="auto" without a calibration, and `xstage-dit calibrate` refusing to
run without a GPU."""
from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest
import torch

from xstage_dit.sp.attention.backends import backends, costs_of
from xstage_dit.burst_gap import AttentionShape, BurstGapModel, Calibration, KernelCosts, Planner, find_calibration
from xstage_dit.sp.moe.modes import ExpertModes
from xstage_dit.burst_gap.moe_plan import ExpertMode, ExpertSchedule, ExpertShape
from xstage_dit.burst_gap.ring_plan import Nodes, RingBlocks, RingTransport
from xstage_dit.burst_gap.ulysses_plan import TileOrder

MiB = 2**20
NVLINK_LIKE = BurstGapModel(issue_latency=0.8e-6, producer_rate=12e9, max_issue_rate=1.4e12, drain_rate=400e9,
                            capacity=4 * MiB)
COSTS = KernelCosts(own_tflops={128: [(4096, 480.0), (65536, 520.0)], 64: [(4096, 340.0), (65536, 390.0)]},
                    vendor_tflops={128: [(4096, 590.0), (65536, 560.0)], 64: [(4096, 440.0), (65536, 460.0)]},
                    copy_rate=1.9e12, alltoall_rate=350e9, launch=4e-6, sms=132)


TILE_ROWS = 128


def _predict(planner: Planner, shape: AttentionShape) -> dict[str, float]:
    """Every registered backend's own prediction."""
    return planner.predict(shape, costs_of(backends()))


def _calibration(topology: str, world_size: int, gpu: str = "NVIDIA H200") -> Calibration:
    return Calibration(gpu, topology, world_size, NVLINK_LIKE, COSTS, {"median": 0.01, "max": 0.05, "samples": 3})


def test_attention_time_interpolates_in_log_tokens_and_clamps():
    flops = 1e12
    mid = COSTS.attention_time(flops, 16384, 128, own=True)
    rate_mid = 480 + (520 - 480) * (math.log(16384) - math.log(4096)) / (math.log(65536) - math.log(4096))
    assert mid == pytest.approx(COSTS.launch + flops / (rate_mid * 1e12))
    assert COSTS.attention_time(flops, 100, 128, own=True) == pytest.approx(COSTS.launch + flops / 480e12)
    assert COSTS.attention_time(flops, 10**6, 96, own=False) == pytest.approx(COSTS.launch + flops / 560e12)


def test_degree_one_predicts_the_kernels_alone():
    planner = Planner(NVLINK_LIKE, COSTS)
    shape = AttentionShape(1, 4096, 512, 24, 128, 1)
    predicted = _predict(planner, shape)
    assert predicted["reference"] == predicted["overlap"] == planner.ulysses.attention(shape, own=False)
    assert predicted["fused"] == planner.ulysses.attention(shape, own=True)
    assert min(predicted, key=predicted.__getitem__) == "reference"  # cuDNN is the faster kernel in these costs


@pytest.mark.parametrize("seq", [8192, 65536])
def test_every_backend_costs_more_than_its_attention(seq):
    planner = Planner(NVLINK_LIKE, COSTS)
    shape = AttentionShape(1, seq, 0, 24, 128, 8)
    predicted = _predict(planner, shape)
    assert predicted["reference"] > planner.ulysses.attention(shape, own=False)
    assert predicted["fused"] > planner.ulysses.attention(shape, own=True)
    assert planner.ulysses.attention(shape, own=False) < predicted["overlap"] <= predicted["reference"]


def test_fused_epilogue_is_free_when_the_q_loop_covers_the_drain():
    # long sequence: each tile's Q loop is far longer than draining a wave of tiles; only the tail remains
    planner = Planner(NVLINK_LIKE, COSTS)
    shape = AttentionShape(1, 65536, 0, 24, 128, 8)
    compute = planner.ulysses.attention(shape, own=True)
    overhead = planner.ulysses.fused_kernel(shape, TileOrder.ROTATED, TILE_ROWS) / compute - 1
    assert 0 < overhead < 0.01


def test_rank_major_order_pays_for_incast_when_drain_limited():
    slow = replace(NVLINK_LIKE, drain_rate=20e9)  # a drain far slower than the waves' stores
    planner = Planner(slow, COSTS)
    shape = AttentionShape(1, 8192, 0, 24, 128, 8)
    assert (planner.ulysses.fused_kernel(shape, TileOrder.RANK_MAJOR, TILE_ROWS)
            > planner.ulysses.fused_kernel(shape, TileOrder.ROTATED, TILE_ROWS))
    assert planner.ulysses.tile_order(shape, TILE_ROWS) is TileOrder.ROTATED
    two = AttentionShape(1, 8192, 0, 24, 128, 2)  # one peer: both orders see the same drain
    assert (planner.ulysses.fused_kernel(two, TileOrder.RANK_MAJOR, TILE_ROWS)
            == planner.ulysses.fused_kernel(two, TileOrder.ROTATED, TILE_ROWS))


def test_calibration_round_trip_and_lookup(tmp_path):
    for topology, world in (("loopback", 1), ("same-gpu", 2), ("nvlink", 8)):
        _calibration(topology, world).save(tmp_path)
    _calibration("nvlink", 8, gpu="NVIDIA B200").save(tmp_path)
    loaded = Calibration.load(tmp_path / "calibration-h200-nvlink-n8.json")
    assert loaded.to_dict() == _calibration("nvlink", 8).to_dict()
    assert find_calibration("NVIDIA H200", 4, "nvlink", tmp_path).topology == "nvlink"
    assert find_calibration("NVIDIA H200", 2, "same-gpu", tmp_path).topology == "same-gpu"
    assert find_calibration("NVIDIA H200", 1, "loopback", tmp_path).world_size == 1
    assert find_calibration("NVIDIA H100", 8, None, tmp_path) is None
    # ranks on GPUs of their own: a real link's calibration (of 8 ranks) before a simulated one of 2
    assert find_calibration("NVIDIA H200", 2, None, tmp_path).topology == "nvlink"


def test_shipped_calibrations_plan_out_of_the_box_and_the_machines_own_win(tmp_path, monkeypatch):
    monkeypatch.setenv("XSTAGE_CALIBRATION_DIR", str(tmp_path))  # nothing measured on this machine yet
    shipped = find_calibration("NVIDIA H200", 1, "loopback")
    assert shipped is not None and shipped.topology == "loopback" and shipped.model.drain_rate > 0
    assert find_calibration("NVIDIA H200", 2, "same-gpu").topology == "same-gpu"
    _calibration("nvlink", 8).save(tmp_path)
    assert find_calibration("NVIDIA H200", 1, "loopback").topology == "nvlink"  # this machine's own, measured


def test_auto_without_calibration_runs_the_reference_on_cpu():
    from xstage_dit.sp.attention.backends import Call, get_choice
    from xstage_dit.sp.attention.layout import UlyssesLayout

    query = torch.randn(1, 8, 4, 16)
    auto = get_choice("auto")
    assert auto.pick(Call(query, UlyssesLayout(0, 16, 8, 2, 0), fabric_ready=False)).name == "reference"
    assert auto.pick(Call(query)).name == "reference"


def test_auto_picks_the_fastest_predicted_backend_it_can_run():
    from xstage_dit.sp.attention.auto import decide

    planner = Planner(NVLINK_LIKE, COSTS)
    shape = AttentionShape(1, 65536, 0, 24, 128, 8)
    every = tuple(backends())
    assert {b.name for b in every} == {"reference", "overlap", "fused"}
    predicted = planner.predict(shape, costs_of(every))
    assert decide(planner, shape, every).name == min(predicted, key=predicted.__getitem__)
    slowest = max(every, key=lambda b: predicted[b.name])
    assert decide(planner, shape, (slowest,)) == slowest  # a backend that cannot run here is never chosen


def test_calibrate_command_needs_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from xstage_dit.cli import main

    with pytest.raises(SystemExit, match="xstage-dit calibrate: needs a CUDA GPU"):
        main(["calibrate", "--out", str(tmp_path)])


class _SimulatedStorePath:
    """A stand-in for BurstProbe whose trains take the times a known model gives (no GPU)."""

    def __init__(self, model: BurstGapModel) -> None:
        self.model = model

    def train(self, destination, producers, volume, bursts, gap, fence=False):
        from xstage_dit.probing.probes import Train

        times = self.model.simulate([(gap, volume)] * bursts, producers)
        if fence:
            times = [self.model.delivery_time(volume, producers)] * bursts
        return Train(producers, volume, gap, times, [gap] * bursts)


def test_the_calibration_sweep_and_fit_recover_a_simulated_store_path():
    from xstage_dit.probing.calibrate import fit, sweep

    samples, visibility = sweep(_SimulatedStorePath(NVLINK_LIKE), None, sms=132, quick=False)
    model, error = fit(samples)
    assert error["median"] < 0.01 and error["samples"] == len(samples) > 100
    for name in ("issue_latency", "producer_rate", "drain_rate"):
        assert getattr(model, name) == pytest.approx(getattr(NVLINK_LIKE, name), rel=0.05), name
    assert all(v["visible_time"] >= v["issue_time"] for v in visibility)


def test_plan_command_prints_predictions_and_the_choice(tmp_path, capsys):
    from xstage_dit.cli import main

    path = _calibration("nvlink", 8).save(tmp_path)
    main(["plan", "--tokens", "65536", "--heads", "24", "--ranks", "8", "--calibration", str(path)])
    printed = capsys.readouterr().out
    assert "extrapolate" not in printed
    assert all(f"{name}:" in printed for name in ("reference", "overlap", "fused"))
    assert "auto runs" in printed and "tile order: rotated" in printed
    with pytest.raises(SystemExit):
        main(["plan", "--tokens", "4096", "--heads", "24", "--ranks", "5", "--ulysses", "5", "--calibration",
              str(path)])
    two = _calibration("nvlink", 2).save(tmp_path)
    main(["plan", "--tokens", "65536", "--heads", "24", "--ranks", "8", "--calibration", str(two)])
    assert "measured 2 rank(s); the predictions for 8 extrapolate" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="plans for this machine's GPU")
@pytest.mark.parametrize("arguments, message", [
    (["--ranks", "0"], "argument --ranks: 0 is not a whole number >= 1"),
    (["--tokens", "-5"], "argument --tokens: -5 is not a whole number >= 1"),
    (["--heads", "many"], "argument --heads: 'many' is not a whole number >= 1"),
    (["--text", "-1"], "argument --text: -1 is not a whole number >= 0"),
    (["--experts", "0"], "argument --experts: 0 is not a whole number >= 1"),
    (["--capacity-factor", "0"], "argument --capacity-factor: 0 is not a finite number > 0"),
    (["--capacity-factor", "nan"], "argument --capacity-factor: nan is not a finite number > 0"),
])
def test_plan_command_refuses_numbers_out_of_range_in_one_line(capsys, arguments, message):
    from xstage_dit.cli import main

    given = {"--tokens": "4096", "--heads": "24", "--ranks": "2", **dict(zip(arguments[::2], arguments[1::2]))}
    with pytest.raises(SystemExit) as exit:
        main(["plan", *[part for pair in given.items() for part in pair]])
    assert exit.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    (None, r"cannot read .*missing.json: No such file or directory"),
    ("not json", r".*bad.json is not a calibration JSON \(Expecting value"),
    ('{"gpu": "H200"}', r".*bad.json is not a calibration: it has no field 'key'"),
])
def test_plan_command_names_the_calibration_it_could_not_read(tmp_path, capsys, content, message):
    from xstage_dit.cli import main

    path = tmp_path / ("missing.json" if content is None else "bad.json")
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit:
        main(["plan", "--tokens", "4096", "--heads", "24", "--ranks", "2", "--calibration", str(path)])
    printed = capsys.readouterr().err
    assert exit.value.code == 2 and printed.startswith("usage: xstage-dit plan ")
    assert re.search(f"xstage-dit plan: error: argument --calibration: {message}", printed), printed


def test_plan_command_without_a_gpu_plans_for_the_shipped_h200(capsys):
    """The README's example: 30 heads cannot split over 8 ranks by Ulysses alone; the plan is a split with a
    ring, and what enable() runs with no degrees."""
    from xstage_dit.cli import main

    main(["plan", "--ranks", "8", "--heads", "30", "--tokens", "4096"])
    printed = capsys.readouterr().out
    assert "shipped calibration-h200-nvlink-n2.json" in printed
    assert "auto runs" not in printed  # no Ulysses-only split of 30 heads over 8 ranks
    assert re.search(r"plan: Ulysses [12] x ring [48], backend (reference|fused), [0-9.]+ ms predicted", printed)
    assert "enable() with no degrees runs Ulysses 2 x ring 4" in printed
    # the fastest X-Stage ring's forward as a Burst-Gap train: a block of 2 x 512 keys of 15 heads, K and V, bf16
    train = re.search(r"fused ring's forward \(Ulysses 2 x ring 4\): ([0-9.]+) MB a step in 1 burst\(s\)", printed)
    assert train and float(train.group(1)) == pytest.approx(2 * 4096 // 4 * 15 * 128 * 2 / 1e6, abs=0.05)


# -- rings ------------------------------------------------------------------------------------------------------
RING_SHAPE = AttentionShape(1, 4 * 8192, 0, 24, 128, 4)  # a ring of 4, 8k tokens a rank


def _slow_sends() -> Planner:
    """Point-to-point far slower than a block's attention; the store path drains far faster."""
    return Planner(replace(NVLINK_LIKE, drain_rate=4e12), replace(COSTS, alltoall_rate=2e9))


@pytest.mark.parametrize("planner", [Planner(NVLINK_LIKE, COSTS), _slow_sends()], ids=["nvlink", "slow-sends"])
def test_ring_transports_follow_their_formulas(planner):
    blocks = RingBlocks.of(RING_SHAPE, 4, 1)
    vendor = planner.rings.steps(blocks)
    send, around = planner.rings.send(blocks, Nodes(8)), planner.rings.ulysses_around(blocks)
    serial = planner.rings.call(RING_SHAPE, 4, 1, "serial")
    overlap = planner.rings.call(RING_SHAPE, 4, 1, RingTransport.OVERLAP)
    fused = planner.rings.call(RING_SHAPE, 4, 1, "fused")
    assert serial == pytest.approx(around + sum(vendor) + 3 * send)
    assert overlap == pytest.approx(around + sum(max(step, send) for step in vendor[:-1]) + vendor[-1])
    assert overlap < serial
    assert around + sum(planner.rings.steps(blocks, own=True)) <= fused  # the stores never make a step shorter
    assert blocks.block_bytes() == 2 * 8192 * 24 * 128 * 2
    if planner.core.costs.alltoall_rate < 1e10:  # sends longer than the attention: they set the pace
        assert overlap == pytest.approx(around + 3 * send + vendor[-1])
        assert fused < overlap  # the store path drains the block under the attention


def test_the_fused_ring_adds_each_forward_s_store_train_to_its_step():
    planner = Planner(NVLINK_LIKE, COSTS)
    blocks = RingBlocks.of(RING_SHAPE, 4, 1)
    steps = planner.rings.steps(blocks, own=True)
    train = planner.rings.forward(blocks)
    forward = train.added
    assert forward > 0 and train.nbytes == blocks.block_bytes()
    assert train.bursts == math.ceil(train.nbytes / train.burst_bytes)  # one a wave of work tiles
    fused = planner.rings.call(RING_SHAPE, 4, 1, "fused")
    assert fused == pytest.approx(planner.rings.ulysses_around(blocks) + sum(steps) + 3 * forward)
    # the block drains under its attention: the train adds far less than the block's delivery in one burst
    assert forward < 0.5 * planner.core.model.delivery_time(blocks.block_bytes(), planner.core.costs.sms)
    # a drain slower than the attention stalls the stores
    slow = Planner(replace(NVLINK_LIKE, drain_rate=5e9), COSTS)
    assert slow.rings.forward(blocks).added > forward
    assert slow.rings.forward(blocks).added > blocks.block_bytes() / 5e9 - sum(steps) / len(steps)


def test_hybrid_rings_split_the_heads_and_blocks():
    shape = AttentionShape(2, 8 * 4096, 77, 30, 128, 8)
    blocks = RingBlocks.of(shape, 4, 2)
    assert (blocks.heads, blocks.block_keys, blocks.query_rows) == (15, 2 * 4096, 77 + 2 * 4096)
    with pytest.raises(ValueError, match="is not the shape's 8 ranks"):
        RingBlocks.of(shape, 2, 2)
    with pytest.raises(ValueError, match="30 heads do not split over ulysses_degree=4"):
        RingBlocks.of(shape, 2, 4)


def test_the_ring_transport_is_the_faster_one_that_can_run():
    from xstage_dit.sp.attention.auto import decide_ring
    from xstage_dit.sp.attention.layout import UlyssesLayout
    from xstage_dit.sp.planner import ring_shape

    layout = UlyssesLayout(text_len=0, seq_len=4 * 8192, local_len=8192, degree=1, rank=0, ring_degree=4)
    shape = ring_shape(torch.empty(1, 8192, 24, 128, dtype=torch.bfloat16), layout)
    assert shape == RING_SHAPE
    every = tuple(backends())
    slow = _slow_sends()
    assert decide_ring(slow, shape, 4, 1, every).ring.planned is RingTransport.FUSED
    # the ring crosses nodes: only the point-to-point ring is predicted, named by the first strategy that sends
    assert slow.predict_ring(shape, 4, 1, costs_of(every), Nodes(2)) == {
        "reference": slow.rings.call(shape, 4, 1, RingTransport.OVERLAP, Nodes(2))}
    planner = Planner(NVLINK_LIKE, COSTS)
    predicted = {t: planner.rings.call(shape, 4, 1, t) for t in (RingTransport.OVERLAP, RingTransport.FUSED)}
    assert decide_ring(planner, shape, 4, 1, every).ring.planned is min(predicted, key=predicted.__getitem__)


def test_layer_splits_keep_ulysses_in_a_node_and_the_fused_ring_off_the_network():
    planner = Planner(NVLINK_LIKE, COSTS)
    costs = costs_of(backends())
    splits = planner.layer_splits(AttentionShape(1, 8 * 4096, 0, 30, 128, 8), Nodes(8), costs)
    assert {(s.ulysses, s.ring) for s in splits} == {(1, 8), (2, 4)}  # 30 heads: Ulysses 1 or 2
    assert [s.seconds for s in splits] == sorted(s.seconds for s in splits)
    assert {s.backend for s in splits} == {"reference", "fused"}
    two_nodes = AttentionShape(1, 16 * 4096, 0, 40, 128, 16)
    splits = planner.layer_splits(two_nodes, Nodes(8), costs)
    assert {(s.ulysses, s.ring) for s in splits} == {(1, 16), (2, 8), (4, 4), (8, 2)}
    assert {s.backend for s in splits} == {"reference"}  # every ring of 16 ranks crosses the nodes
    with pytest.raises(ValueError, match="the fused ring spans one node"):
        planner.rings.call(two_nodes, 2, 8, "fused", Nodes(8))
    # the network is slower than NVLink: the same ring predicts longer across nodes
    assert (planner.rings.call(two_nodes, 2, 8, "serial", Nodes(8))
            > planner.rings.call(two_nodes, 2, 8, "serial", Nodes(16)))
    whole = planner.layer_splits(AttentionShape(1, 8 * 4096, 0, 24, 128, 8), Nodes(8), costs)
    assert {s.backend for s in whole if s.ring == 1} == {"reference", "overlap", "fused"}


def test_version(capsys):
    from xstage_dit.cli import main

    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("xstage-dit ")


EXPERT_RATES = {"own": [(64, 250.0), (256, 520.0), (2048, 600.0)],
                "vendor": [(64, 300.0), (256, 560.0), (2048, 650.0)]}
MOE_1024 = ExpertShape(batch=1, tokens=4096, dim=2048, width=1344, experts=64, capacity=256, degree=2)


def test_expert_predictions_follow_the_model():
    """Stores beat collectives on a slow all-to-all and lose nothing to a fast store path; a drain-limited store
    path makes the planner space the combine stores out (interleaved), a fast one keeps the fewest launches."""
    costs = replace(COSTS, expert_tflops=EXPERT_RATES)
    planner = Planner(NVLINK_LIKE, costs)
    assert planner.experts.calibrated() and not Planner(NVLINK_LIKE, COSTS).experts.calibrated()
    predicted = planner.experts.predict(MOE_1024, tuple(ExpertMode))
    assert predicted[ExpertMode.STORES] < predicted[ExpertMode.COLLECTIVES]
    assert planner.experts.schedule(MOE_1024) == ExpertSchedule()
    slow = Planner(replace(NVLINK_LIKE, drain_rate=5e9, capacity=64 * 1024), costs)
    schedule = slow.experts.schedule(MOE_1024)
    assert schedule.interleaved
    assert slow.experts.stores(MOE_1024, schedule) < slow.experts.stores(MOE_1024, ExpertSchedule())


def test_expert_rates_round_trip_and_older_calibrations_have_none():
    costs = replace(COSTS, expert_tflops=EXPERT_RATES)
    assert KernelCosts.from_dict(costs.to_dict()) == costs
    older = COSTS.to_dict()
    del older["expert_tflops"]
    assert KernelCosts.from_dict(older).expert_tflops == {}


def test_expert_modes_follow_expert_parallel():
    assert ExpertModes.resolve(None, 1, True).allowed == (ExpertMode.REPLICATED,)
    assert ExpertModes.resolve(False, 2, True).allowed == (ExpertMode.REPLICATED,)
    assert ExpertModes.resolve(True, 2, False).allowed == (ExpertMode.COLLECTIVES,)
    assert ExpertModes.resolve(True, 2, True).allowed == (ExpertMode.STORES,)
    assert ExpertModes.resolve(None, 2, True).allowed == (ExpertMode.REPLICATED, ExpertMode.STORES,
                                                         ExpertMode.COLLECTIVES)
    assert ExpertModes.resolve(True, 2, True).sharded
    undecided = ExpertModes.resolve(None, 2, True)
    assert undecided.allowed[0] is ExpertMode.REPLICATED and not undecided.sharded
    assert undecided.choose(MOE_1024, torch.device("cpu")) is ExpertMode.REPLICATED  # no planner on the CPU


def test_plan_command_prints_the_moe_prediction(tmp_path, capsys):
    from xstage_dit.cli import main

    calibration = _calibration("nvlink", 2)
    calibration.costs = replace(COSTS, expert_tflops=EXPERT_RATES)
    path = calibration.save(tmp_path)
    main(["plan", "--tokens", "4096", "--heads", "16", "--ranks", "2", "--experts", "64", "--calibration", str(path)])
    printed = capsys.readouterr().out
    assert all(mode.value in printed for mode in ExpertMode)
    assert "the stores mode's schedule: 1 wave" in printed and "expert_parallel=None runs" in printed
