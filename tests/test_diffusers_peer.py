"""The peer-check plugin (tests/diffusers_peer.py) in one process: a supported transformer is enabled as soon as it
is built or loaded, and the undo leaves diffusers as it was. The peer run itself (tests/run_diffusers_peer.py)
needs a checkout of diffusers' tests and is not part of this suite."""
from __future__ import annotations

import diffusers
import torch

import diffusers_peer
import xstage_dit
from xstage_dit.patches import supported_models


def test_models_are_enabled_when_built_or_loaded_until_the_undo(tmp_path):
    stock = diffusers.FluxTransformer2DModel(in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
                                             num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8,
                                             axes_dims_rope=(2, 2, 4))
    stock.save_pretrained(tmp_path)
    before = [vars(cls)["__init__"] for cls in supported_models()], vars(diffusers.ModelMixin)["from_pretrained"]
    undo = diffusers_peer.install()
    try:
        built = type(stock)(**stock.config)
        loaded = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path)
        assert xstage_dit.installed_layers(built) and xstage_dit.installed_layers(loaded)
        assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), stock.state_dict().values()))
    finally:
        undo()
    assert not xstage_dit.installed_layers(type(stock)(**stock.config))
    assert ([vars(cls)["__init__"] for cls in supported_models()],
            vars(diffusers.ModelMixin)["from_pretrained"]) == before
