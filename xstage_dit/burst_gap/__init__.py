"""The X-Stage: the Burst-Gap model of device-initiated remote stores, its calibration record and the planner;
pure Python, no GPU. The tools that measure a machine for it are in probing/."""
from .calibration import Calibration, KernelCosts, find_calibration
from .model import BurstGapModel
from .planner import Planner
from .ulysses_plan import AttentionShape

__all__ = ["AttentionShape", "BurstGapModel", "Calibration", "KernelCosts", "Planner", "find_calibration"]
