"""The Burst-Gap planner for this machine, and the attention shape of a call as the planner sees it.

The planner needs this GPU's calibration (`xstage-dit calibrate`). Every rank reads the same calibration and
sees the same shape, so every rank of a group makes the same decisions (they must: the backends' collectives,
and the fused kernel's destinations, differ)."""
from __future__ import annotations

import torch

from ..logging_utils import logger
from ..runtime.distributed import job_placement
from ..burst_gap.calibration import find_calibration
from ..burst_gap.planner import Planner
from ..burst_gap.ulysses_plan import AttentionShape
from ..sizes import fp8_payload_bytes
from .attention.layout import UlyssesLayout


# each planner by what it is read from: the GPU, the ranks, whether they share GPUs; emptied by `disable`
_planners: dict[tuple[torch.device, int, bool], Planner | None] = {}


def planner_for(device: torch.device, world_size: int) -> Planner | None:
    """The planner from this GPU's calibration for `world_size` ranks; None without one (or on CPU)."""
    if device.type != "cuda":
        return None
    shared = job_placement().ranks_share_gpus
    key = (device, world_size, shared)
    if key not in _planners:
        _planners[key] = _read_planner(device, world_size, shared)
    return _planners[key]


def _read_planner(device: torch.device, world_size: int, shared: bool) -> Planner | None:
    calibration = find_calibration(torch.cuda.get_device_name(device), world_size, "same-gpu" if shared else None)
    if calibration is None:
        return None
    logger.info("xstage_dit: planning with %s (%s, %d ranks)", calibration.filename, calibration.topology,
                calibration.world_size)
    return Planner.from_calibration(calibration)


def forget_planners() -> None:
    _planners.clear()


def attention_shape(query: torch.Tensor, layout: UlyssesLayout | None,
                    fp8_payloads: bool = False) -> AttentionShape:
    """One call's shape: a rank's (B, T + L, H, D) query under `layout`, or the whole sequence (layout None:
    degree 1); `fp8_payloads`: the fused path's stores send FP8 payloads."""
    batch, tokens, heads, head_dim = query.shape
    if layout is None:
        return AttentionShape(batch, tokens, 0, heads, head_dim, 1, query.element_size())
    return AttentionShape(batch, layout.seq_len, layout.text_len, heads, head_dim, layout.degree,
                          query.element_size(), fp8_payload_bytes(head_dim) if fp8_payloads else None)


def ring_shape(query: torch.Tensor, layout: UlyssesLayout) -> AttentionShape:
    """A ring call's shape as `RingPlanner.call` takes it: a rank's (B, T + L, H, D) query, the whole sequence
    over layout.ring_degree x layout.degree ranks."""
    batch, _, heads, head_dim = query.shape
    return AttentionShape(batch, layout.seq_len, layout.text_len, heads, head_dim, layout.ring_degree * layout.degree,
                          query.element_size())
