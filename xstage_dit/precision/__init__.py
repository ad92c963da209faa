"""What runs in FP8 (XStageConfig.fp8): which steps of a pipeline call (steps.py), and the Linear layers
(linear.py)."""
