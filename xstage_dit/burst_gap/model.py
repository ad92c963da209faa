"""The Burst-Gap model (X-Stage paper): issuer-visible issue time of bursts of device-initiated remote stores.

K producers inject a burst of V bytes at I(K) = min(K * b, Bmax) after a fixed issue latency t0. Accepted bytes
wait in a finite downstream queue of capacity Q that drains at R; once it is full, injection is throttled to R
(backpressure). A useful gap G between bursts lets the queue drain. Closed forms:

    free_issue_time(V, K)       = t0 + V / I(K)                        (T0_iss: backpressure-free)
    steady_issue_time(G, V, K)  = max(T0_iss(K, V), V / R - G)         (T_iss: long train of bursts)
    delivery_time(V, K)         = t0 + V / min(I(K), R)                 (an isolated burst lands)

`simulate` runs the fluid queue exactly for any train; `fit` recovers the parameters from measured trains.
All quantities in SI units: seconds, bytes, bytes per second."""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence


@dataclass(frozen=True)
class BurstGapModel:
    issue_latency: float  # t0 [s]
    producer_rate: float  # b [bytes/s per producer]
    max_issue_rate: float  # Bmax [bytes/s]
    drain_rate: float  # R [bytes/s]
    capacity: float  # Q [bytes]

    def injection_rate(self, producers: int) -> float:
        """I(K) = min(K * b, Bmax)."""
        return min(producers * self.producer_rate, self.max_issue_rate)

    def free_issue_time(self, volume: float, producers: int) -> float:
        """T0_iss(K, V) = t0 + V / I(K)."""
        return self.issue_latency + volume / self.injection_rate(producers)

    def steady_issue_time(self, gap: float, volume: float, producers: int) -> float:
        """T_iss(G; K, V) = max(T0_iss(K, V), V / R - G)."""
        return max(self.free_issue_time(volume, producers), volume / self.drain_rate - gap)

    def delivery_time(self, volume: float, producers: int) -> float:
        """Time until the last byte of an isolated burst has left the queue (the destination sees the data):
        bytes enter at I(K) and leave at R, so the slower of the two sets the pace after t0."""
        return self.issue_latency + volume / min(self.injection_rate(producers), self.drain_rate)

    def simulate(self, bursts: Iterable[tuple[float, float]], producers: int) -> list[float]:
        """Issuer-visible issue time of each burst of a train of (gap_before_seconds, volume_bytes), starting
        from an empty queue. The queue drains at R whenever it holds bytes (during gaps, t0 and injection);
        injection runs at I(K) until the queue holds Q bytes, then at R with the queue held at Q."""
        rate, drain, capacity = self.injection_rate(producers), self.drain_rate, self.capacity
        outstanding = 0.0
        times = []
        for gap, volume in bursts:
            outstanding = max(0.0, outstanding - drain * (gap + self.issue_latency))
            if rate <= drain:
                # the queue never grows: injection is never throttled
                inject_time = volume / rate
                outstanding = max(0.0, outstanding - (drain - rate) * inject_time)
            else:
                time_to_full = (capacity - outstanding) / (rate - drain)
                if volume <= rate * time_to_full:
                    inject_time = volume / rate
                    outstanding += (rate - drain) * inject_time
                else:
                    inject_time = time_to_full + (volume - rate * time_to_full) / drain
                    outstanding = capacity
            times.append(self.issue_latency + inject_time)
        return times

    def predict(self, producers: int, volume: float, gap: float, bursts: int) -> float:
        """Issue time of the last burst of `bursts` identical bursts, each preceded by `gap`."""
        return self.simulate([(gap, volume)] * bursts, producers)[-1]

    @classmethod
    def fit(cls, samples: Sequence[dict]) -> "BurstGapModel":
        """Least-squares fit (relative errors) to records {"producers", "volume", "gap", "bursts",
        "issue_time"}: `issue_time` is the measured issue time of the last burst of a train of `bursts`
        identical bursts each preceded by `gap`, from an empty queue.

        The loss has flat regions (a capacity no burst reaches, rates no burst is limited by) where a simplex
        stalls, so the fit starts from several capacities and restarts the simplex from its best point until
        the loss stops improving."""
        names = ("issue_latency", "producer_rate", "max_issue_rate", "drain_rate", "capacity")

        def loss(log_params: list[float]) -> float:
            model = cls(**dict(zip(names, (math.exp(p) for p in log_params))))
            return sum(math.log(model.predict(s["producers"], s["volume"], s["gap"], s["bursts"])
                                / s["issue_time"]) ** 2 for s in samples)

        best, best_loss = None, math.inf
        for start in _initial_guesses(samples):
            point = [math.log(getattr(start, n)) for n in names]
            value = loss(point)
            for _ in range(8):
                point = _nelder_mead(loss, point)
                improved = loss(point)
                if improved > value * (1 - 1e-6):
                    break
                value = improved
            if value < best_loss:
                best, best_loss = point, value
        return cls(**dict(zip(names, (math.exp(p) for p in best))))

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> "BurstGapModel":
        return cls(**{k: float(data[k]) for k in ("issue_latency", "producer_rate", "max_issue_rate",
                                                   "drain_rate", "capacity")})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "BurstGapModel":
        return cls.from_dict(json.loads(Path(path).read_text()))


def _initial_guesses(samples: Sequence[dict]) -> list[BurstGapModel]:
    """Starting points near the answer. Isolated bursts: per producer count, the line through the two smallest
    volumes gives t0 (intercept) and I(K) (inverse slope), so b and Bmax; gap-free trains: the slowest rate
    V/T_iss is at most R (it equals R where they are drain-limited). The capacity is the least identifiable
    parameter: one start per volume scale of the samples."""
    isolated = [s for s in samples if s["bursts"] == 1] or list(samples)
    intercepts, rates = [], {}
    for producers in sorted({s["producers"] for s in isolated}):
        points = sorted((s["volume"], s["issue_time"]) for s in isolated if s["producers"] == producers)
        if len(points) >= 2 and points[1][0] > points[0][0] and points[1][1] > points[0][1]:
            (v0, t0), (v1, t1) = points[:2]
            slope = (t1 - t0) / (v1 - v0)
            intercepts.append(t0 - slope * v0)
            rates[producers] = 1.0 / slope
        else:
            rates[producers] = points[0][0] / points[0][1]
    latency = max(statistics.median(intercepts), 1e-8) if intercepts else 0.5 * min(s["issue_time"] for s in isolated)
    per_producer = max(rate / k for k, rate in rates.items())
    peak = max(rates.values())
    trains = [s for s in samples if s["bursts"] > 1 and s["gap"] <= min(t["gap"] for t in samples)] or list(samples)
    drain = min(s["volume"] / s["issue_time"] for s in trains)
    volumes = sorted({s["volume"] for s in samples})
    scales = {volumes[0], volumes[len(volumes) // 2], volumes[-1], 4 * volumes[-1]}
    return [BurstGapModel(latency, per_producer, peak, drain, q) for q in sorted(scales)]


def _nelder_mead(f, x0: list[float], step: float = 0.5, iterations: int = 4000, tol: float = 1e-12
                 ) -> list[float]:
    """Minimise f over R^n with the Nelder-Mead simplex (no SciPy dependency)."""
    n = len(x0)
    simplex = [list(x0)] + [[x + (step if i == j else 0.0) for j, x in enumerate(x0)] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if abs(values[-1] - values[0]) < tol:
            break
        centroid = [sum(x[j] for x in simplex[:-1]) / n for j in range(n)]

        def toward(coefficient: float) -> list[float]:
            return [c + coefficient * (w - c) for c, w in zip(centroid, simplex[-1])]

        reflected = toward(-1.0)
        f_reflected = f(reflected)
        if f_reflected < values[0]:
            expanded = toward(-2.0)
            f_expanded = f(expanded)
            simplex[-1], values[-1] = (expanded, f_expanded) if f_expanded < f_reflected else (reflected, f_reflected)
        elif f_reflected < values[-2]:
            simplex[-1], values[-1] = reflected, f_reflected
        else:
            contracted = toward(0.5)
            f_contracted = f(contracted)
            if f_contracted < values[-1]:
                simplex[-1], values[-1] = contracted, f_contracted
            else:  # shrink toward the best point
                simplex = [simplex[0]] + [[b + 0.5 * (x - b) for b, x in zip(simplex[0], p)] for p in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[min(range(n + 1), key=values.__getitem__)]
