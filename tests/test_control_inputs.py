"""What pipelines add to the transformer's inputs, under the token split: ControlNet residuals (the ControlNet's own
blocks split like the transformer's, its residuals handed over as this rank's tokens) and IP-Adapter image-prompt
tokens (whole on every rank, attended by each rank's image queries). Equal to one process (CPU, float32, gloo)."""
from __future__ import annotations

import pytest
import torch

import xstage_dit
from xstage_dit.testing import zoo
from dist_harness import run_on_ranks
from numerics import relative_error
from pipeline_checks import SIZES, TOLERANCE, pipelines_worker

# the library's CPU paths (conftest.py): these tests' subject is not our kernels, which their own tests run
pytestmark = pytest.mark.cpu_paths

# the single Flux ControlNet runs in the IP-Adapter's worker
CONTROLNETS = ["tiny-flux-multi-controlnet", "tiny-qwenimage-controlnet", "tiny-zimage-controlnet"]


def _ip_adapter_worker(name: str, load_after_enable: bool, cfg_degree: int = 1) -> None:
    """A ControlNet pipeline with an IP-Adapter, true CFG with negative image embeds, 35 image tokens; the adapter
    loaded before `enable`, or after it and unloaded again (diffusers then makes the other modules' processors
    anew, of their class)."""
    pipe = zoo.build_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(11)
    embeds = {kwarg: [torch.randn(2, 1, zoo.IP_ADAPTER_EMBED_DIM, generator=generator)]
              for kwarg in ("ip_adapter_image_embeds", "negative_ip_adapter_image_embeds")}
    kwargs = dict(zoo.call_kwargs(name, **SIZES[name]["uneven"], steps=2, guidance=3.0),
                  **zoo.text_embeddings(name, 2, seed=2), output_type="latent", return_dict=False)

    def generate(**extra) -> torch.Tensor:
        return pipe(**kwargs, **extra, generator=torch.Generator().manual_seed(7))[0]

    def load() -> None:
        pipe.transformer._load_ip_adapter_weights(zoo.random_ip_adapter(pipe.transformer))

    plain = generate() if load_after_enable else None
    load()
    ref = generate(**embeds)
    if load_after_enable:
        assert relative_error(plain, ref) > 1e-2, "the IP-Adapter changed nothing: the test would prove nothing"
        pipe.unload_ip_adapter()
        xstage_dit.enable(pipe, timeout_s=120, cfg_degree=cfg_degree)
        load()
    else:
        xstage_dit.enable(pipe, timeout_s=120, cfg_degree=cfg_degree)
    error = relative_error(generate(**embeds), ref)
    assert error < TOLERANCE, f"{name} with an IP-Adapter: relative error {error:.2e}"
    if load_after_enable:
        pipe.unload_ip_adapter()
        error = relative_error(generate(), plain)
        assert error < TOLERANCE, f"{name} with its IP-Adapter unloaded: relative error {error:.2e}"
        xstage_dit.disable(pipe)
        assert torch.equal(generate(), plain), "disable did not restore the model"
    else:
        xstage_dit.disable(pipe)
        assert torch.equal(generate(**embeds), ref), "disable did not restore the model with its IP-Adapter"


def _flux2_kv_worker(text_len: int, degrees: dict) -> None:
    """FLUX.2 [dev]'s transformer (guidance embedded) with the KV-cache processors: a call that extracts the cache
    of 12 reference tokens before 35 image tokens, then one that reads it; batch 2."""
    from diffusers import Flux2Transformer2DModel
    from diffusers.models.transformers.transformer_flux2 import (Flux2KVAttnProcessor,
                                                                 Flux2KVParallelSelfAttnProcessor)

    torch.manual_seed(0)
    model = Flux2Transformer2DModel(**zoo.ZOO["tiny-flux2"].transformer).eval()
    for block in model.transformer_blocks:
        block.attn.set_processor(Flux2KVAttnProcessor())
    for block in model.single_transformer_blocks:
        block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())
    generator = torch.Generator().manual_seed(6)
    reference, image = (torch.randn(2, tokens, 16, generator=generator) for tokens in (12, 35))
    reference_ids, image_ids = (torch.randint(0, 16, (tokens, 4), generator=generator) for tokens in (12, 35))
    common = dict(encoder_hidden_states=torch.randn(2, text_len, 32, generator=generator),
                  txt_ids=torch.randint(0, 16, (text_len, 4), generator=generator), guidance=torch.tensor([3.5, 3.5]),
                  return_dict=False)

    def run() -> list[torch.Tensor]:
        with torch.no_grad():
            first, cache = model(hidden_states=torch.cat([reference, image], dim=1),
                                 img_ids=torch.cat([reference_ids, image_ids]), timestep=torch.tensor([0.9, 0.9]),
                                 kv_cache_mode="extract", num_ref_tokens=12, **common)
            later = model(hidden_states=image, img_ids=image_ids, timestep=torch.tensor([0.5, 0.5]), kv_cache=cache,
                          kv_cache_mode="cached", **common)[0]
        return [first, later]

    refs = run()
    xstage_dit.enable(model, timeout_s=120, **degrees)
    outs = run()
    xstage_dit.disable(model)
    for step, out, ref in zip(("extract", "cached"), outs, refs):
        error = relative_error(out, ref)
        assert error < TOLERANCE, f"FLUX.2 KV cache, {step} call: relative error {error:.2e}"
    assert all(map(torch.equal, run(), refs)), "disable did not restore the model"


def _whole_residuals_worker() -> None:
    """The enabled transformer alone, given a stock ControlNet's residuals over the whole sequence (35 tokens): it
    splits them like its own tokens."""
    from pipeline_checks import bare_transformer_inputs

    pipe = zoo.build_pipeline("tiny-flux-controlnet")
    inputs = bare_transformer_inputs("tiny-flux", torch.Generator().manual_seed(3))
    with torch.no_grad():
        blocks, single_blocks = pipe.controlnet(**inputs, controlnet_cond=torch.randn(2, 35, 16),
                                                conditioning_scale=0.7, return_dict=False)
        inputs.update(controlnet_block_samples=blocks, controlnet_single_block_samples=single_blocks)
        ref = pipe.transformer(**inputs).sample
        xstage_dit.enable(pipe.transformer, timeout_s=120)
        error = relative_error(pipe.transformer(**inputs).sample, ref)
    assert error < TOLERANCE, f"a bare transformer given whole residuals: relative error {error:.2e}"
    with pytest.raises(TypeError, match="enable the pipeline instead"):
        xstage_dit.enable(pipe.controlnet)


def _whole_zimage_hints_worker() -> None:
    """The enabled Z-Image transformer alone, given a stock ControlNet's hints over the whole image (64 tokens,
    padded from 35, and a caption of each length; 3 ranks: uneven): it splits them like its own tokens."""
    pipe = zoo.build_pipeline("tiny-zimage-controlnet")
    generator = torch.Generator().manual_seed(3)
    inputs = {"x": [torch.randn(4, 1, 10, 14, generator=generator) for _ in range(2)], "t": torch.tensor([0.3, 0.3]),
              "cap_feats": [torch.randn(length, 32, generator=generator) for length in (40, 28)]}
    with torch.no_grad():
        hints = pipe.controlnet(**inputs, control_context=[torch.randn(4, 1, 10, 14, generator=generator)] * 2,
                                conditioning_scale=0.7)
        ref = pipe.transformer(**inputs, controlnet_block_samples=hints, return_dict=False)[0]
        xstage_dit.enable(pipe.transformer, timeout_s=120)
        out = pipe.transformer(**inputs, controlnet_block_samples=hints, return_dict=False)[0]
    error = relative_error(torch.stack(out), torch.stack(ref))
    assert error < TOLERANCE, f"a bare Z-Image transformer given whole hints: relative error {error:.2e}"
    xstage_dit.disable(pipe.transformer)
    with pytest.raises(TypeError, match="enable the pipeline instead"):
        xstage_dit.enable(pipe.controlnet)


def test_flux2_reference_kv_cache_in_one_process():
    """Degree 1: the rebound KV attention leaves diffusers' own."""
    _flux2_kv_worker(5, {})


def _every_feature_worker(world_size: int) -> None:
    """One spawn of ranks runs each feature in turn (a spawn's start-up costs more than a tiny pipeline): the
    ControlNet pipelines and FLUX.2 [klein]'s KV-cache pipeline (batch 2; 35 image tokens, which Z-Image pads to 64;
    on 2 ranks as a ring, on 3 under Ulysses, with Z-Image's inpainting ControlNet too, batch 1), the IP-Adapter on
    the single-ControlNet pipeline under Ulysses (loaded after `enable` on 2 ranks, before it on 3), FLUX.2 [dev]'s
    KV cache (2 ranks: a ring, the prompt whole; 3: Ulysses, the prompt split with the tokens); on 3 ranks also a
    bare transformer given whole residuals (Flux's, Z-Image's)."""
    ring = {"ring_degree": 2} if world_size == 2 else {}
    # Z-Image's inpainting ControlNet where its 64 tokens split unevenly
    inpaint = ["tiny-zimage-controlnet-inpaint"] if world_size == 3 else []
    pipelines_worker([*CONTROLNETS, *inpaint, "tiny-flux2-klein-kv"], 1, 3.0, "reference", False, None, ring)
    _ip_adapter_worker("tiny-flux-controlnet", load_after_enable=world_size == 2)
    if world_size == 2:
        _flux2_kv_worker(5, ring)
    else:
        _flux2_kv_worker(6, {})
        _whole_residuals_worker()
        _whole_zimage_hints_worker()


@pytest.mark.parametrize("world_size", [2, 3])
def test_control_inputs_match_single_process(world_size: int):
    run_on_ranks(world_size, _every_feature_worker, world_size, deadline_s=600)


def _cfg_parallel_worker() -> None:
    pipelines_worker(CONTROLNETS, 2, 3.0, "reference", False, None)
    _ip_adapter_worker("tiny-flux-controlnet", load_after_enable=False, cfg_degree=2)


def test_control_inputs_with_cfg_parallel_match_single_process():
    """cfg_degree=2: each branch's rank computes the ControlNet's residuals, which serve both branches, and its
    branch's IP-Adapter image embeds."""
    run_on_ranks(2, _cfg_parallel_worker, deadline_s=600)
