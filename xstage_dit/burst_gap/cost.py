"""The calibrated cost core that every planning domain (burst_gap/ulysses_plan.py, ring_plan.py, moe_plan.py)
prices its work with: one machine's fitted Burst-Gap model of device-initiated remote stores and its measured
kernel costs, and the pieces built from them alone: a copy, one tensor's trip through an all-to-all, and what a
train of store bursts adds to the compute it rides on."""
from __future__ import annotations

from dataclasses import dataclass

from .calibration import KernelCosts
from .model import BurstGapModel


def store_train(path: BurstGapModel, gap: float, burst_bytes: float, producers: int, bursts: int) -> float:
    """What a train of `bursts` bursts of remote stores, each `burst_bytes` from `producers` programs after `gap`
    seconds of their compute, adds to that compute: every burst after the first stalls its issuers by
    max(0, T_iss - T0_iss) = max(0, V/R - G - T0_iss), and the last burst's bytes must land before the
    destination may read them (delivery minus issue)."""
    free = path.free_issue_time(burst_bytes, producers)
    stall = max(0.0, path.steady_issue_time(gap, burst_bytes, producers) - free)
    return max(0, bursts - 1) * stall + path.delivery_time(burst_bytes, producers) - free


@dataclass(frozen=True)
class CostCore:
    """One machine's calibration as the planners read it: `model`, its store path (the fitted Burst-Gap model),
    and `costs`, its measured kernel costs."""

    model: BurstGapModel
    costs: KernelCosts

    def copy(self, nbytes: float) -> float:
        return self.costs.launch + nbytes / self.costs.copy_rate

    def exchange(self, nbytes: float, text: bool) -> float:
        """One tensor's trip through an all-to-all of the reference path: pack, all-to-all, unpack (+ join)."""
        transfer = self.costs.launch + nbytes / self.costs.alltoall_rate
        return transfer + (3 if text else 2) * self.copy(nbytes)
