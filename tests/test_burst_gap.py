"""The Burst-Gap model: closed forms against the fluid-queue simulation, and the fit on noisy synthetic data."""
from __future__ import annotations

import math
import random

import pytest

from xstage_dit.burst_gap import BurstGapModel

MiB = 2**20
# the order of magnitude of the paper's system: t0 ~0.76 us, R ~717 GB/s, Q ~4.25 MiB
PAPER_LIKE = BurstGapModel(issue_latency=0.76e-6, producer_rate=12e9, max_issue_rate=1.4e12, drain_rate=717e9,
                           capacity=4.25 * MiB)


def _random_model(rng: random.Random) -> BurstGapModel:
    return BurstGapModel(issue_latency=rng.uniform(0.2e-6, 3e-6), producer_rate=rng.uniform(2e9, 50e9),
                         max_issue_rate=rng.uniform(0.8e12, 3e12), drain_rate=rng.uniform(0.2e12, 0.9e12),
                         capacity=rng.uniform(0.5, 16) * MiB)


@pytest.mark.parametrize("seed", range(20))
def test_isolated_burst_below_capacity_costs_free_issue_time(seed):
    rng = random.Random(seed)
    model = _random_model(rng)
    producers = rng.choice([1, 4, 16, 64, 132])
    rate = model.injection_rate(producers)
    # the largest burst that cannot fill the queue from empty
    limit = model.capacity * rate / (rate - model.drain_rate) if rate > model.drain_rate else 1e12
    volume = rng.uniform(0.01, 0.99) * min(limit, 64 * MiB)
    assert math.isclose(model.simulate([(0.0, volume)], producers)[0], model.free_issue_time(volume, producers),
                        rel_tol=1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_long_train_settles_at_steady_issue_time(seed):
    """Where the closed form holds: a saturated queue (it never empties between bursts: R (G + t0) <= Q, and
    drain-limited: V/R - G >= T0_iss), or a backpressure-free train (each burst drains before the next and
    never fills the queue)."""
    rng = random.Random(seed)
    model = _random_model(rng)
    producers = rng.choice([16, 64, 132])
    rate, drain = model.injection_rate(producers), model.drain_rate
    volume = rng.uniform(0.5, 8) * MiB
    gaps = (0.0, 0.5 * (model.capacity / drain - model.issue_latency))
    saturating_gaps = [g for g in gaps if g >= 0 and drain * (g + model.issue_latency) <= model.capacity]
    for gap in saturating_gaps:
        if volume / drain - gap >= model.free_issue_time(volume, producers):
            times = model.simulate([(gap, volume)] * 400, producers)
            assert math.isclose(times[-1], model.steady_issue_time(gap, volume, producers), rel_tol=1e-9)
    small = 0.9 * model.capacity * rate / max(rate - drain, 1e-9)  # cannot fill the queue from empty
    free_gap = 2.0 * small / drain
    times = model.simulate([(free_gap, small)] * 50, producers)
    assert math.isclose(times[-1], model.steady_issue_time(free_gap, small, producers), rel_tol=1e-9)
    assert math.isclose(times[-1], model.free_issue_time(small, producers), rel_tol=1e-9)


def test_backpressure_onset_and_regimes():
    model, volume, producers = PAPER_LIKE, 2 * MiB, 132
    no_gap = model.steady_issue_time(0.0, volume, producers)
    assert math.isclose(no_gap, volume / model.drain_rate)  # drain-dominated
    long_gap = model.steady_issue_time(1e-3, volume, producers)
    assert math.isclose(long_gap, model.free_issue_time(volume, producers))  # backpressure-free


def test_json_round_trip(tmp_path):
    path = tmp_path / "model.json"
    PAPER_LIKE.save(path)
    assert BurstGapModel.load(path) == PAPER_LIKE
    assert BurstGapModel.from_dict(PAPER_LIKE.to_dict()) == PAPER_LIKE


def _samples(model: BurstGapModel, noise: float, rng: random.Random) -> list[dict]:
    samples = []
    for producers in (1, 2, 8, 32, 132):
        for volume in (8e3, 64e3, 512e3, 2 * MiB, 8 * MiB, 32 * MiB):
            for gap, bursts in ((0.0, 1), (0.0, 32), (2e-6, 32), (10e-6, 32)):
                measured = model.predict(producers, volume, gap, bursts) * math.exp(rng.gauss(0.0, noise))
                samples.append({"producers": producers, "volume": volume, "gap": gap, "bursts": bursts,
                                "issue_time": measured})
    return samples


def test_fit_recovers_known_parameters_from_noisy_samples():
    rng = random.Random(0)
    fitted = BurstGapModel.fit(_samples(PAPER_LIKE, noise=0.02, rng=rng))
    for name, truth in PAPER_LIKE.to_dict().items():
        assert math.isclose(getattr(fitted, name), truth, rel_tol=0.1), f"{name}: {getattr(fitted, name)} vs {truth}"


@pytest.mark.parametrize("seed", range(10))
def test_delivery_of_an_isolated_burst_is_paced_by_the_slower_side(seed):
    model = _random_model(random.Random(seed))
    for producers in (1, 16, 132):
        volume = 8 * MiB
        landed = model.delivery_time(volume, producers)
        assert landed >= model.free_issue_time(volume, producers) - 1e-15
        assert landed == pytest.approx(model.issue_latency + volume / min(model.injection_rate(producers),
                                                                          model.drain_rate))
