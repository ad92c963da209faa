"""Z-Image: image tokens through refiner layers of their own, then one stream of [image, caption] tokens through
the main layers (single-stream attention, text last); a separate refiner attends within the caption.

The model pads its inputs into batches itself (`_prepare_sequence`, then `_build_unified_sequence`), so the split
happens there: the image tokens' batch is split before the noise refiner, together with its rotary table, and
the unified sequence is built from each rank's image chunk and the whole caption, its padding mask with it. The
caption refiner runs whole on every rank (its short sequence is not routed). The final layer's output is gathered
back: image tokens from every rank, the caption's rows as they are. Its basic mode only: one image per prompt, all
images of one batch of one size (the captions' lengths may differ).

A ControlNet (ZImageControlNetPipeline's and ZImageControlNetInpaintPipeline's) shares the transformer's embedders
and refiners and builds its sequences inline, so its enabled forward is ours (`_SplitControlNet`): the image and
control tokens split after their embedding, the transformer's noise refiner run on the image chunk (split by the
shard its routed attention reads), the ControlNet's own blocks on the control chunk, then on [chunk, whole caption]
like the transformer's main layers. Its hints (`SplitHints`) hold this rank's rows, which the transformer adds to
its own, each call's hints first fitted to the rows it builds (`_FittedHints`)."""
from __future__ import annotations

from typing import Any

import torch
from diffusers import ZImageControlNetModel, ZImageTransformer2DModel
from diffusers.models.transformers.transformer_z_image import SEQ_MULTI_OF
from torch import nn
from torch.utils._pytree import register_pytree_node

from ...cfg.plan import BATCH, CfgPlan
from ...hooks.module_forward import ReplacedForward, forward_signature
from ...sizes import ceil_div
from ...sp.attention import routing
from ...sp.plan import FAMILY_CHANGES, PlanContext, SequenceParallelPlan
from ...sp.sharding import SequenceShard

_CONTROLNET = "diffusers.models.controlnets.controlnet_z_image"
_HINTS = "controlnet_block_samples"  # the transformer's forward argument that takes a ControlNet's hints


def _check_inputs(arguments: dict[str, Any]) -> None:
    if isinstance(arguments["x"][0], list) or arguments.get("siglip_feats") is not None:
        raise NotImplementedError("xstage_dit: Z-Image's omni mode (several images per prompt, SigLIP features) "
                                  "is not supported yet")
    _check_one_size(arguments["x"])


def _check_one_size(images: list[torch.Tensor]) -> None:
    if len({tuple(image.shape) for image in images}) > 1:
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


class SplitHints(dict):
    """A ControlNet's hints, layer index -> (B, rows, D), over this rank's [image chunk, caption] rows (what an
    enabled ControlNet returns); a plain dict's rows hold the whole image."""


# a pytree node like a dict: CUDA graphs see the hints' tensors as a forward's inputs and outputs
register_pytree_node(SplitHints, lambda hints: (list(hints.values()), list(hints)),
                     lambda values, keys: SplitHints(zip(keys, values)))


def _padded_rows(tokens: int) -> int:
    """Tokens as the model pads each image and caption: to a multiple of SEQ_MULTI_OF."""
    return ceil_div(tokens, SEQ_MULTI_OF) * SEQ_MULTI_OF


class _FittedHints:
    """The ControlNet hints a forward gets, fitted to the [image, caption] rows it builds: whole image rows (a
    ControlNet not enabled) split to this rank's chunk, and rows past the call's longest caption dropped (the CFG
    split hands each branch hints padded to both branches' longest caption; past its own they are padding).
    Innermost of the forward's wrappers, so it sees the call's own half of a CFG batch. `remove()` restores it."""

    def __init__(self, model: ZImageTransformer2DModel, shard: SequenceShard) -> None:
        self.shard = shard
        self._signature = forward_signature(model)
        self._position = list(self._signature.parameters).index(_HINTS)
        self._replaced = ReplacedForward(model, self._forward)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get(_HINTS) is None and (len(args) <= self._position or args[self._position] is None):
            return self._replaced.inner(*args, **kwargs)  # no ControlNet: nothing bound on every call
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        bound.arguments[_HINTS] = self._fitted(bound.arguments)
        return self._replaced.inner(*bound.args, **bound.kwargs)

    def _fitted(self, arguments: dict[str, Any]) -> dict[int, torch.Tensor]:
        hints = arguments[_HINTS]
        _, frames, height, width = arguments["x"][0].shape
        patch, frame_patch = arguments["patch_size"], arguments["f_patch_size"]
        image_rows = _padded_rows((frames // frame_patch) * (height // patch) * (width // patch))
        rows = (ceil_div(image_rows, self.shard.degree)
                + max(_padded_rows(len(caption)) for caption in arguments["cap_feats"]))
        whole = self.shard.degree > 1 and not isinstance(hints, SplitHints)
        fitted = {}
        for index, hint in hints.items():
            if whole:
                hint = torch.cat([self.shard.shard(hint[:, :image_rows], 1), hint[:, image_rows:]], dim=1)
            fitted[index] = hint[:, :rows]
        return fitted

    def remove(self) -> None:
        self._replaced.restore()


def _install(model: nn.Module, context: PlanContext) -> list[Any]:
    split = [_SplitSequences(model, context.shard)] if context.shard.degree > 1 else []
    return [*split, _FittedHints(model, context.shard)]


class _SplitControlNet:
    """The ControlNet's forward on this rank's image tokens, the same computation as diffusers' (whose inline
    sequences no hook can split), for one image size per call: the image tokens are split by `refiner_shard`,
    the shard the transformer's noise refiner (which the ControlNet runs) attends by, the control tokens by the
    ControlNet's own. `remove()` restores diffusers' forward."""

    def __init__(self, model: ZImageControlNetModel, shard: SequenceShard, refiner_shard: SequenceShard) -> None:
        self.model, self.shard, self.refiner_shard = model, shard, refiner_shard
        self._replaced = ReplacedForward(model, self.forward)

    def forward(self, x: list[torch.Tensor], t: torch.Tensor, cap_feats: list[torch.Tensor],
                control_context: list[torch.Tensor], conditioning_scale: float = 1.0, patch_size: int = 2,
                f_patch_size: int = 1) -> SplitHints:
        model = self.model
        embedder = f"{patch_size}-{f_patch_size}"
        images, captions, _, image_ids, caption_ids, image_padding, caption_padding = model.patchify_and_embed(
            x, cap_feats, patch_size, f_patch_size)
        controls = model.patchify(control_context, patch_size, f_patch_size)
        padding = torch.stack(image_padding).unsqueeze(-1)
        tokens = torch.where(padding, model.x_pad_token, model.all_x_embedder[embedder](torch.stack(images)))
        control = torch.where(padding, model.x_pad_token,
                              model.control_all_x_embedder[embedder](torch.stack(controls)))
        freqs = model.rope_embedder(torch.cat(image_ids)).unflatten(0, (len(images), -1))
        adaln = model.t_embedder(t * model.t_scale).type_as(tokens)
        tokens, freqs = self.refiner_shard.shard(tokens, 1), self.refiner_shard.shard(freqs, 1)
        control = self.shard.shard(control, 1)

        refiner_hints = {}
        if model.add_control_noise_refiner is not None:  # control blocks beside the noise refiner (2.x)
            layers = (model.control_layers if model.add_control_noise_refiner == "control_layers"
                      else model.control_noise_refiner)
            control, refiner_hints = _control_stack(layers, control, tokens, None, freqs, adaln,
                                                    model.control_refiner_layers_places, conditioning_scale)
        for index, layer in enumerate(model.noise_refiner):  # image-only attention: no mask (one image size)
            tokens = layer(tokens, None, freqs, adaln)
            if index in refiner_hints:
                tokens = tokens + refiner_hints[index]
        if model.add_control_noise_refiner is None:
            for layer in model.control_noise_refiner:
                control = layer(control, None, freqs, adaln)

        # the caption whole on every rank, refined as the transformer does; then [image chunk, caption] streams
        device = tokens.device
        caption_lens = [len(caption) for caption in captions]
        captions, caption_freqs, caption_mask, _, _ = ZImageTransformer2DModel._prepare_sequence(
            model, list(model.cap_embedder(torch.cat(captions)).split(caption_lens)), caption_ids, caption_padding,
            model.cap_pad_token, None, device)
        for layer in model.context_refiner:
            captions = layer(captions, caption_mask, caption_freqs)
        chunks = [tokens.shape[1]] * len(images)

        def unified(image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
            return ZImageTransformer2DModel._build_unified_sequence(
                model, image, freqs, chunks, None, captions, caption_freqs, caption_lens, None, siglip=None,
                siglip_freqs=None, siglip_seqlens=None, siglip_noise_mask=None, omni_mode=False, device=device)[:3]

        tokens, unified_freqs, unified_mask = unified(tokens)
        _, hints = _control_stack(model.control_layers, unified(control)[0], tokens, unified_mask, unified_freqs,
                                  adaln, model.control_layers_places, conditioning_scale)
        return SplitHints(hints)

    def remove(self) -> None:
        self._replaced.restore()


def _control_stack(layers: nn.ModuleList, control: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor | None,
                   freqs: torch.Tensor, adaln: torch.Tensor, places: list[int], scale: float
                   ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Control blocks in turn (each stacks its hint before the running control state), the state they end on,
    and their hints scaled, by the transformer layer each is added after."""
    for layer in layers:
        control = layer(control, tokens, mask, freqs, adaln)
    *hints, control = control.unbind(0)
    return control, {place: hint * scale for place, hint in zip(places, hints)}


def _check_controlnet(model: nn.Module) -> None:
    if model.noise_refiner is None:
        raise ValueError("xstage_dit: this ZImageControlNetModel holds none of its transformer's modules yet; its "
                         "pipelines share them with it (ZImageControlNetModel.from_transformer)")


def _install_controlnet(model: nn.Module, context: PlanContext) -> list[Any]:
    if context.shard.degree == 1:
        return []
    refiner = routing.marked_attention(model.noise_refiner[0].attention)
    if refiner is None:
        raise ValueError("xstage_dit: this ZImageControlNetModel runs the noise refiner of a transformer that is "
                         "not enabled; enable the pipeline that holds it and the transformer it was made from "
                         "(ZImageControlNetModel.from_transformer)")
    return [_SplitControlNet(model, context.shard, refiner.shard)]


def _check_controlnet_inputs(arguments: dict[str, Any]) -> None:
    _check_one_size(arguments["x"])


PLANS = {
    ZImageTransformer2DModel: SequenceParallelPlan(
        family="Z-Image",
        call_site=("diffusers.models.transformers.transformer_z_image", routing.DISPATCH),
        attention_modules=lambda model: [layer.attention for layer in (*model.noise_refiner, *model.layers)],
        num_heads=lambda model: model.config.n_heads,
        # its pipeline stacks [conditional, unconditional] in one call's lists
        cfg=CfgPlan(BATCH, batch_inputs={"x": 0, "t": 0, "cap_feats": 0, _HINTS: 0}),
        text_first=False,
        check_inputs=_check_inputs,
        installs={FAMILY_CHANGES: _install},
    ),
    ZImageControlNetModel: SequenceParallelPlan(
        family="Z-Image ControlNet",
        call_site=(_CONTROLNET, routing.DISPATCH),
        # its own blocks; the noise refiner it shares is the transformer's, routed by the transformer's plan
        attention_modules=lambda model: [block.attention for block in
                                         (*model.control_layers, *(model.control_noise_refiner or ()))],
        num_heads=lambda model: model.config.n_heads,
        cfg=None,
        text_first=False,
        check_model=_check_controlnet,
        check_inputs=_check_controlnet_inputs,
        installs={FAMILY_CHANGES: _install_controlnet},
    ),
}
