"""The X-Stage: the Burst-Gap model of device-initiated remote stores, its calibration and the planner."""
from .calibration import Calibration, KernelCosts, find_calibration
from .model import BurstGapModel
from .planner import AttentionShape, Planner

__all__ = ["AttentionShape", "BurstGapModel", "Calibration", "KernelCosts", "Planner", "find_calibration"]
