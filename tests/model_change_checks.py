"""What the model-change tests share: a small FLUX.1 call, and the check that each change moves the keys of both
readers of a watched model (the ranks' check and a CUDA-graphed forward)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from xstage_dit.runtime.model_changes import ModelChanges


def flux_inputs(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """A FLUX.1 transformer call on 4 image and 3 text tokens."""
    return {"hidden_states": torch.randn(1, 4, model.config.in_channels),
            "encoder_hidden_states": torch.randn(1, 3, model.config.joint_attention_dim),
            "pooled_projections": torch.randn(1, model.config.pooled_projection_dim),
            "timestep": torch.tensor([0.5]), "img_ids": torch.zeros(4, 3), "txt_ids": torch.zeros(3, 3),
            "guidance": torch.tensor([3.0]) if model.config.guidance_embeds else None}


def assert_moves(model: nn.Module, sequence: list[tuple[str, Callable[[], object], bool, bool]]) -> None:
    """Each change of `sequence` (what, the change, whether the check's key moves, whether the graphs' key moves),
    made under no_grad, moves the keys of both readers of `model` as it says."""
    check = ModelChanges(model, writes=True, storage=False)
    graphs = ModelChanges(model, writes=False, storage=True)
    for what, change, check_moves, graphs_move in sequence:
        with torch.no_grad():
            change()
        assert (check.moved(), graphs.moved()) == (check_moves, graphs_move), what
    check.remove()
    graphs.remove()
