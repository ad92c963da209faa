"""Z-Image: image tokens through refiner layers of their own, then one stream of [image, caption] tokens through
the main layers (single-stream attention, text last); a separate refiner attends within the caption.

The model pads its inputs into batches itself (`_prepare_sequence`, then `_build_unified_sequence`), so the split
happens there: the image tokens' batch is split before the noise refiner, together with its rotary table, and
the unified sequence is built from each rank's image chunk and the whole caption, its padding mask with it. The
caption refiner runs whole on every rank (its short sequence is not routed). The final layer's output is gathered
back: image tokens from every rank, the caption's rows as they are. Its basic mode only: one image per prompt, all
images of one batch of one size (the captions' lengths may differ)."""
from __future__ import annotations

from typing import Any

import torch
from diffusers import ZImageTransformer2DModel
from torch import nn

from ...cfg.plan import BATCH, CfgPlan
from ...sp.attention import routing
from ...sp.plan import PlanContext, SequenceParallelPlan
from ...sp.sharding import SequenceShard


def _check_inputs(arguments: dict[str, Any]) -> None:
    if isinstance(arguments["x"][0], list) or arguments.get("siglip_feats") is not None:
        raise NotImplementedError("xstage_dit: Z-Image's omni mode (several images per prompt, SigLIP features) "
                                  "is not supported yet")
    if arguments.get("controlnet_block_samples") is not None:
        raise NotImplementedError("xstage_dit: Z-Image with ControlNet residuals is not supported yet")
    if len({tuple(image.shape) for image in arguments["x"]}) > 1:
        raise NotImplementedError("xstage_dit: Z-Image with images of different sizes in one batch is not "
                                  "supported: every image of a call must have one size")


class _SplitSequences:
    """Rebinds the model's `_prepare_sequence` (for its image tokens) and `_build_unified_sequence` to split the
    image tokens, and gathers the final layer's output; `remove()` restores them."""

    def __init__(self, model: ZImageTransformer2DModel, shard: SequenceShard) -> None:
        self.model, self.shard = model, shard
        prepare, unify = model._prepare_sequence, model._build_unified_sequence

        def prepare_sequence(feats, pos_ids, inner_pad_mask, pad_token, noise_mask=None, device=None):
            prepared = prepare(feats, pos_ids, inner_pad_mask, pad_token, noise_mask, device)
            if pad_token is not model.x_pad_token:  # the caption's, whole on every rank
                return prepared
            tokens, freqs, *rest = prepared  # the padding mask is None: every image has one size
            return (shard.shard(tokens, 1), shard.shard(freqs, 1), *rest)

        def build_unified_sequence(x, x_freqs, x_seqlens, *args, **kwargs):
            # each sample's image part is this rank's chunk, padding included
            return unify(x, x_freqs, [shard.local_len] * len(x_seqlens), *args, **kwargs)

        model._prepare_sequence = prepare_sequence
        model._build_unified_sequence = build_unified_sequence
        self._hooks = [final.register_forward_hook(self._gather) for final in model.all_final_layer.values()]

    def _gather(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return self.shard.gather_leading(output, 1)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        del self.model._prepare_sequence, self.model._build_unified_sequence


def _install(model: nn.Module, context: PlanContext) -> list[Any]:
    return [_SplitSequences(model, context.shard)] if context.shard.degree > 1 else []


PLANS = {
    ZImageTransformer2DModel: SequenceParallelPlan(
        family="Z-Image",
        call_site=("diffusers.models.transformers.transformer_z_image", routing.DISPATCH),
        attention_modules=lambda model: [layer.attention for layer in (*model.noise_refiner, *model.layers)],
        num_heads=lambda model: model.config.n_heads,
        # its pipeline stacks [conditional, unconditional] in one call's lists
        cfg=CfgPlan(BATCH, batch_inputs={"x": 0, "t": 0, "cap_feats": 0}),
        text_first=False,
        check_inputs=_check_inputs,
        install=_install,
    )
}
