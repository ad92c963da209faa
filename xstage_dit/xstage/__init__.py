"""The X-Stage: the Burst-Gap model of device-initiated remote stores, and (later) its calibration and planner."""
from .model import BurstGapModel

__all__ = ["BurstGapModel"]
