"""The Burst-Gap planner for this machine, and the attention shape of a call as the planner sees it.

The planner needs this GPU's calibration (`xstage-dit calibrate`). Every rank reads the same calibration and
sees the same shape, so every rank of a group makes the same decisions (they must: the backends' collectives,
and the fused kernel's destinations, differ)."""
from __future__ import annotations

from functools import lru_cache

import torch

from ..logging_utils import logger
from ..runtime.distributed import ranks_share_gpus
from ..burst_gap.calibration import find_calibration
from ..burst_gap.planner import AttentionShape, Planner
from .attention.layout import UlyssesLayout


@lru_cache(maxsize=None)
def planner_for(device: torch.device, world_size: int) -> Planner | None:
    """The planner from this GPU's calibration for `world_size` ranks; None without one (or on CPU)."""
    if device.type != "cuda":
        return None
    gpu = torch.cuda.get_device_name(device)
    calibration = find_calibration(gpu, world_size, "same-gpu" if ranks_share_gpus() else None)
    if calibration is None:
        return None
    logger.info("xstage_dit: planning with %s (%s, %d ranks)", calibration.filename, calibration.topology,
                calibration.world_size)
    return Planner.from_calibration(calibration)


def attention_shape(query: torch.Tensor, layout: UlyssesLayout | None) -> AttentionShape:
    """One call's shape: a rank's (B, T + L, H, D) query under `layout`, or the whole sequence (layout None:
    degree 1)."""
    batch, tokens, heads, head_dim = query.shape
    if layout is None:
        return AttentionShape(batch, tokens, 0, heads, head_dim, 1, query.element_size())
    return AttentionShape(batch, layout.seq_len, layout.text_len, heads, head_dim, layout.degree,
                          query.element_size())


def ring_shape(query: torch.Tensor, layout: UlyssesLayout) -> AttentionShape:
    """A ring call's shape as `Planner.ring_call` takes it: a rank's (B, T + L, H, D) query, the whole sequence
    over layout.ring_degree x layout.degree ranks."""
    batch, _, heads, head_dim = query.shape
    return AttentionShape(batch, layout.seq_len, layout.text_len, heads, head_dim, layout.ring_degree * layout.degree,
                          query.element_size())
