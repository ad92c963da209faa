"""fp8="linear": a transformer's projections run torchao's FP8 GEMMs (`Float8DynamicActivationFloat8WeightConfig`
with rowwise scales: each output row of the weight and each token of the activation gets its own float32 scale,
the activation's computed at every call), chosen layer by layer (`fp8_layers`), undone exactly by `remove()`.

Which layers: the plain `nn.Linear`s inside the model's repeated blocks (`_repeated_blocks`: nearly all of a
DiT's FLOPs), except
- the layers the model keeps in float32 (diffusers' `_keep_in_fp32_modules`, or a weight in another dtype than the
  model's): the model's authors found them sensitive to rounding in bf16 already;
- the layers matching diffusers' `_skip_layerwise_casting_patterns`, which diffusers keeps out of FP8 *storage*
  (FP8 GEMMs round the activations too). In FLUX.1 and Wan these are the adaptive norms' modulation projections,
  which run on one row per sample (nothing to gain) and scale and shift every token (much to lose);
- the layers outside the blocks (the embedders of the noisy latents, timesteps and text, the final projection):
  they run on few rows, or feed the model's output directly, and hold a tiny part of the FLOPs;
- shapes FP8 GEMMs cannot take (in or out features not a multiple of 16).

The weight a layer holds becomes torchao's FP8 weight, as `quantize_` makes it. Its original is kept for `remove()`:
with `keep_full_precision` (fp8_full_precision_steps > 0) on the device, as the layer's non-persistent buffer
`full_precision_weight`, and the layer becomes a `SwitchedLinear`, which runs the one its step's precision says (a
flag read, nothing quantized again); otherwise in host memory, so that the device holds the FP8 weights alone.

The fusions that compute a layer from its weight (the GELU epilogue, FLUX.1's and Chroma's split projection) see a
layer that is not a plain Linear and run diffusers' code for it, with one warning each (fusions/plain.py): the
split projection would change the dynamic activation scales, and under torch.compile the GELU fuses into the next
layer's activation quantization instead of the GEMM's epilogue."""
from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..fusions.plain import why_not_plain_tensor
from ..hooks.module_forward import SwappedClasses
from ..logging_utils import logger
from .steps import StepPrecision

FP8_GEMM_CAPABILITY = (8, 9)  # Ada, Hopper, Blackwell: the GPUs with FP8 tensor cores
FP8_GEMM_MULTIPLE = 16  # what `torch._scaled_mm` needs of a GEMM's inner and outer dims


# the least largest |x| an activation row's scale is computed from: a row of zeros (padding tokens: Z-Image's
# attention projections see them) would otherwise get the scale 0 and quantize to 0 / 0, NaN, and the GEMM spread
# the NaN nowhere else but its own output row, which attention then spreads everywhere. With a floor torchao
# quantizes activations with torch operations (which torch.compile fuses), not MSLK's row kernel, which takes none.
ACTIVATION_FLOOR = 1e-12


def quantization_config(floored: bool = True) -> Any:
    """torchao's config of the FP8 weights: float8 e4m3 weights and activations, rowwise scales, each activation
    row's scale from at least ACTIVATION_FLOOR (`floored`; without, torchao's default as users configure it)."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

    # torchao's recommended inductor settings are process-wide: left to the user (docs/usage.md)
    return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False,
                                                     activation_value_lb=ACTIVATION_FLOOR if floored else None)


def why_no_fp8_gemms(device: torch.device) -> str | None:
    """Why this rank's device cannot run FP8 GEMMs; None where it can."""
    if device.type != "cuda":
        return f"this rank runs on {device}"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_GEMM_CAPABILITY:
        return (f"this rank's {torch.cuda.get_device_name(device)} has compute capability "
                f"{capability[0]}.{capability[1]}")
    return None


def check_fp8_linear(model: nn.Module, device: torch.device) -> None:
    """Raises, in words, where fp8="linear" cannot run `model` on `device` (asked before any collective)."""
    name = type(model).__name__
    why = why_no_fp8_gemms(device)
    if why is not None:
        raise ValueError(f"fp8='linear' runs torchao's FP8 GEMMs, which need a CUDA GPU of compute capability "
                         f"{FP8_GEMM_CAPABILITY[0]}.{FP8_GEMM_CAPABILITY[1]} or above; {why}")
    if importlib.util.find_spec("torchao") is None:
        raise ImportError("fp8='linear' runs torchao's FP8 GEMMs: pip install torchao")
    for weight_name, weight in model.named_parameters():
        why = why_not_plain_tensor(weight_name, weight)
        if why is not None:
            raise ValueError(f"fp8='linear' quantizes {name}'s Linear layers itself, and {name} is quantized already "
                             f"(it {why}): enable without fp8 to run your quantization as it is, or give enable "
                             f"the model unquantized")
    dtype = getattr(model, "dtype", None)
    if dtype != torch.bfloat16:
        raise ValueError(f"fp8='linear' runs a bfloat16 model's projections in FP8; {name} is {dtype} (load it "
                         f"with torch_dtype=torch.bfloat16)")
    elsewhere = sorted({str(p.device) for p in model.parameters() if p.device.type != device.type})
    if elsewhere:
        raise ValueError(f"fp8='linear' quantizes {name}'s weights where they are, and some are on "
                         f"{', '.join(elsewhere)}: move the pipeline to the GPU before enable")


def _inside_blocks(model: nn.Module) -> set[int]:
    """The ids of the modules inside the model's repeated blocks (all of them where it names none)."""
    names = set(getattr(model, "_repeated_blocks", None) or ())
    if not names:
        return {id(module) for module in model.modules()}
    return {id(inner) for module in model.modules() if type(module).__name__ in names for inner in module.modules()}


@dataclass
class LayerChoice:
    """The Linear layers of a model that run FP8, by name, and the names of the others, by the reason."""

    chosen: dict[str, nn.Linear] = field(default_factory=dict)
    skipped: dict[str, list[str]] = field(default_factory=dict)

    def skip(self, reason: str, name: str) -> None:
        self.skipped.setdefault(reason, []).append(name)


def fp8_layers(model: nn.Module) -> LayerChoice:
    """Which of `model`'s Linear layers run FP8 (the module docstring's rules)."""
    keep_fp32 = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    skip_patterns = list(getattr(model, "_skip_layerwise_casting_patterns", None) or ())
    in_blocks = _inside_blocks(model)
    choice = LayerChoice()
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        if keep_fp32 & set(name.split(".")) or module.weight.dtype != model.dtype:
            choice.skip("kept in float32", name)
        elif any(re.search(pattern, name) for pattern in skip_patterns):
            choice.skip("diffusers' layerwise-casting skip patterns", name)
        elif id(module) not in in_blocks:
            choice.skip("outside the repeated blocks", name)
        elif module.in_features % FP8_GEMM_MULTIPLE or module.out_features % FP8_GEMM_MULTIPLE:
            choice.skip(f"features not a multiple of {FP8_GEMM_MULTIPLE}", name)
        else:
            choice.chosen[name] = module
    return choice


class SwitchedLinear(nn.Linear):
    """A Linear holding torchao's FP8 weight (`weight`) and its original (`full_precision_weight`); each call runs
    the one its model's step precision (`step_precision`) says."""

    step_precision: StepPrecision

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.step_precision.fp8("linear") else self.full_precision_weight
        return F.linear(input, weight, self.bias)


@dataclass
class _Quantized:
    layer: nn.Linear
    original: nn.Parameter  # its weight before, its storage on the host where the device keeps only FP8
    had_extra_repr: bool  # `quantize_` sets the layer's own extra_repr


FULL_PRECISION_WEIGHT = "full_precision_weight"


class Fp8Linears:
    """`fp8_layers(model)` run FP8 from construction until `remove()`, which gives each layer its original
    weight back (the same parameter, the same values, on the device the layer is on then). With
    `keep_full_precision` they switch per step with `precision`. `config`: what torchao quantizes with
    (`quantization_config()` by default)."""

    def __init__(self, model: nn.Module, precision: StepPrecision, keep_full_precision: bool,
                 config: Any = None) -> None:
        from torchao.quantization import quantize_

        config = quantization_config() if config is None else config
        choice = fp8_layers(model)
        self._quantized: list[_Quantized] = []
        self._swap: SwappedClasses | None = None
        try:
            for layer in choice.chosen.values():
                original, had_extra_repr = layer.weight, "extra_repr" in layer.__dict__
                quantize_(layer, config, filter_fn=lambda module, _: module is layer)
                self._quantized.append(_Quantized(layer, original, had_extra_repr))
                if keep_full_precision:
                    layer.register_buffer(FULL_PRECISION_WEIGHT, original.detach(), persistent=False)
                    layer.step_precision = precision
                else:  # one layer at a time: the device never holds much more than the model
                    original.data = original.data.to("cpu")
            if keep_full_precision:
                self._swap = SwappedClasses([quantized.layer for quantized in self._quantized], SwitchedLinear)
        except BaseException:  # the layers quantized so far get their weights back
            self.remove()
            raise
        skipped = "; ".join(f"{len(names)} {reason}" for reason, names in choice.skipped.items())
        logger.info("xstage_dit: fp8='linear': %d Linear layers of %s run torchao's FP8 GEMMs%s",
                    len(self._quantized), type(model).__name__, f" (not: {skipped})" if skipped else "")

    def remove(self) -> None:
        if self._swap is not None:
            self._swap.remove()
            self._swap = None
        for quantized in reversed(self._quantized):
            layer, original = quantized.layer, quantized.original
            if FULL_PRECISION_WEIGHT in layer._buffers:  # where the layer is now (`.to()` moves it with the layer)
                original.data = getattr(layer, FULL_PRECISION_WEIGHT)
                delattr(layer, FULL_PRECISION_WEIGHT)
                del layer.step_precision
            else:
                original.data = original.data.to(layer.weight.device)
            layer.weight = original
            if not quantized.had_extra_repr:
                del layer.extra_repr
        self._quantized = []
