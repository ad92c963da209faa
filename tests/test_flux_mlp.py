"""fusions/gelu.py (tanh-GELU feed-forwards with the GELU in the GEMM epilogue) and patches/image/flux_mlp.py (FLUX.1's
and Chroma's single-stream output projection split in two GEMMs) against diffusers' modules on fresh random
inputs."""
from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers import transformer_chroma, transformer_flux

import xstage_dit
from xstage_dit.testing import zoo
from xstage_dit.fusions.gelu import EpilogueGELU, epilogue_gelus
from xstage_dit.patches.image.flux_mlp import SPLIT_BLOCKS, split_projection_blocks


def _blocks_and_ff(device: str, dtype: torch.dtype, dim: int, heads: int):
    torch.manual_seed(0)
    single = transformer_flux.FluxSingleTransformerBlock(dim, heads, dim // heads).to(device, dtype)
    chroma = transformer_chroma.ChromaSingleTransformerBlock(dim, heads, dim // heads).to(device, dtype)
    dual = transformer_flux.FluxTransformerBlock(dim, heads, dim // heads).to(device, dtype)
    for module in (single, chroma, dual):
        for parameter in module.parameters():  # not the initial ones (zero biases, unit norms)
            torch.nn.init.normal_(parameter, 0.0, 0.05)
    return single, chroma, dual.ff


def _check(device: str, dtype: torch.dtype, tolerance: float, dim: int = 256, heads: int = 4) -> None:
    single, chroma, ff = _blocks_and_ff(device, dtype, dim, heads)
    text, image = (torch.randn(2, n, dim, device=device, dtype=dtype) for n in (7, 61))
    temb = torch.randn(2, dim, device=device, dtype=dtype)
    chroma_temb = torch.randn(2, 3, dim, device=device, dtype=dtype)
    token_mask = (torch.rand(2, 68, device=device) > 0.2).to(dtype)
    angles = 10 * torch.rand(68, dim // 4, device=device)
    rotary = (angles.cos(), angles.sin())
    joined = torch.cat([text, image], dim=1)

    def run() -> tuple[torch.Tensor, ...]:
        return (*single(image, text, temb, rotary), chroma(joined, chroma_temb, rotary, token_mask), ff(image))

    with torch.no_grad():
        expected = run()
        modules = torch.nn.ModuleList([single, chroma, ff])
        originals = [type(module) for module in modules]
        swaps = [epilogue_gelus(modules), *split_projection_blocks(modules)]
        assert [type(module) for module in modules] == [*SPLIT_BLOCKS.values(), type(ff)]
        assert type(ff.net[0]) is EpilogueGELU
        got = run()
        for swap in swaps:
            swap.remove()
    assert [type(module) for module in modules] == originals and type(ff.net[0]).__name__ == "GELU"
    assert type(ff.net[0]) is not EpilogueGELU
    for out, ref in zip(got, expected):
        error = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        assert error <= tolerance, f"max error {error:.2e} of the largest value"


def test_fused_mlp_equals_diffusers_modules():
    _check("cpu", torch.float32, tolerance=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_mlp_equals_diffusers_modules_on_gpu(dtype):
    # the epilogue GELU of the float32 accumulator and the projection's two roundings against diffusers' roundings
    _check("cuda", dtype, tolerance=2 * (2.0**-7 if dtype == torch.bfloat16 else 2.0**-10))


@pytest.mark.parametrize("name", ["tiny-flux", "tiny-wan"])
def test_enable_swaps_the_layers_under_their_names_and_disable_restores_them(name):
    pipe = zoo.build_pipeline(name)
    model = pipe.transformer
    before = {name: type(module) for name, module in model.named_modules()}
    xstage_dit.enable(pipe)
    try:
        kinds = {type(module) for module in model.modules()}
        assert EpilogueGELU in kinds and (SPLIT_BLOCKS[transformer_flux.FluxSingleTransformerBlock] in kinds) is (
            name == "tiny-flux")
        # compile_repeated_blocks finds the blocks by these names
        assert {type(module).__name__ for module in model.modules()} == {kind.__name__ for kind in before.values()}
    finally:
        xstage_dit.disable(pipe)
    assert {name: type(module) for name, module in model.named_modules()} == before


def test_fuse_mlp_false_keeps_diffusers_layers():
    pipe = zoo.build_pipeline("tiny-flux")
    xstage_dit.enable(pipe, fuse_mlp=False)
    try:
        kinds = {type(module) for module in pipe.transformer.modules()}
        assert not kinds & {EpilogueGELU, *SPLIT_BLOCKS.values()}
        assert transformer_flux.FluxSingleTransformerBlock in kinds
    finally:
        xstage_dit.disable(pipe)
