"""How a model family's pipelines run classifier-free guidance: the declarative record a patch fills in and
cfg/split.py carries out. It sits below sp/ and cfg/split.py, which both read it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

BATCH = "batch"
PAIRS = "pairs"


@dataclass(frozen=True)
class CfgPlan:
    """How a model family's pipelines do CFG.

    mode: BATCH or PAIRS.
    batch_inputs: forward argument name -> its batch dim, for the arguments that carry the batch (BATCH); lists
        (e.g. per-sample sizes, or per-sample inputs) are split like dim 0, and so is each tensor of a dict (a
        ControlNet's residuals by block). The first one's size is the batch.
    output_shape: the forward output's shape from the model and the call's arguments, unsharded (PAIRS).
    pipeline_uses_cfg: whether a pipeline call with these (bound, defaults applied) arguments runs CFG (PAIRS).
    """

    mode: str
    batch_inputs: dict[str, int] = field(default_factory=dict)
    output_shape: Callable[[nn.Module, dict[str, Any]], tuple[int, ...]] | None = None
    pipeline_uses_cfg: Callable[[dict[str, Any]], bool] | None = None
