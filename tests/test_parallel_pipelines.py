"""The parallel pipeline equals the single-process pipeline (float32, CPU, real gloo processes).

The ranks run the stock pipeline first (single-process references: each call on one rank, its result shared with
the others), then the same calls with xstage_dit enabled, for batch 1 and 2 and for token counts that do and do not
divide by the degree."""
from __future__ import annotations

import math

import pytest
import torch

import xstage_dit
from xstage_dit.testing import zoo
from dist_harness import run_on_ranks, xstage_warnings
from numerics import relative_error
from pipeline_checks import (LTX2_CONFIG, QWENIMAGE21_CONFIG, SIZES, TOLERANCE, bare_transformer_inputs,
                             local_statistics, per_pipeline, pipeline_worker, qwenimage21_inputs, seeded_latents)

# pipelines that take images: Kontext's and Qwen-Image Edit's reference tokens are split with the image tokens,
# the others' image latents travel with the noise's channels; LTX image-to-video and Condition and Wan 2.2 TI2V
# have per-token timesteps, Qwen-Image Edit-2511 a per-token modulation index, split with the tokens
ULYSSES = {
    2: ["tiny-flux", "tiny-wan", "tiny-wan2.2", "tiny-hunyuan-video", "tiny-qwenimage", "tiny-ltx", "tiny-sd3.5",
        "tiny-cogvideox", "tiny-hidream", "tiny-flux-fill", "tiny-wan2.2-i2v", "tiny-qwenimage-edit",
        "tiny-qwenimage-edit-plus", "tiny-nucleusmoe", "tiny-flux2", "tiny-flux2-klein", "tiny-wan-vace",
        "tiny-zimage", "tiny-chroma", "tiny-ltx2", "tiny-qwenimage21"],
    3: ["tiny-flux", "tiny-wan", "tiny-hunyuan-video", "tiny-qwenimage", "tiny-ltx", "tiny-sd3.5", "tiny-cogvideox",
        "tiny-hidream", "tiny-flux-kontext", "tiny-flux-control", "tiny-ltx-i2v", "tiny-ltx-condition",
        "tiny-wan2.2-ti2v", "tiny-wan2.1-i2v", "tiny-qwenimage-edit-2511", "tiny-nucleusmoe", "tiny-flux2",
        "tiny-flux2-klein", "tiny-flux2-edit", "tiny-wan-vace", "tiny-zimage", "tiny-chroma", "tiny-hunyuan-video15",
        "tiny-zimage-img2img", "tiny-zimage-inpaint", "tiny-chroma-img2img", "tiny-ltx2",
        "tiny-ltx2-i2v", "tiny-qwenimage21"],
    4: ["tiny-flux", "tiny-wan", "tiny-nucleusmoe", "tiny-flux2"],
}
# (world size, guidance) -> pipelines: every family at 2 x 1 (pipelines calling the transformer once per branch,
# then batching ones); CFG and Ulysses together (2 x 2) for each way of calling: pairs, pairs over two
# transformers, pairs with a text mask, a batch (Z-Image's through its ControlNet pipeline: its transformer with
# the hints split along the batch); guidance off: every CFG group computes every call
CFG = {
    (2, 3.0): ["tiny-flux", "tiny-wan", "tiny-wan2.2", "tiny-hunyuan-video", "tiny-qwenimage", "tiny-sd3.5",
               "tiny-cogvideox", "tiny-ltx", "tiny-hidream", "tiny-flux-kontext", "tiny-wan2.2-i2v", "tiny-ltx-i2v",
               "tiny-ltx-condition", "tiny-wan2.2-ti2v", "tiny-wan2.1-i2v", "tiny-nucleusmoe", "tiny-flux2-klein",
               "tiny-wan-vace", "tiny-zimage", "tiny-chroma", "tiny-ltx2", "tiny-ltx2-i2v",
               "tiny-qwenimage21", "tiny-hunyuan-video15", "tiny-qwenimage-edit-2511"],
    (4, 3.0): ["tiny-flux", "tiny-wan2.2", "tiny-hunyuan-video", "tiny-sd3.5", "tiny-ltx-i2v",
               "tiny-ltx-condition", "tiny-nucleusmoe", "tiny-flux2-klein", "tiny-zimage-controlnet",
               "tiny-qwenimage21"],
    (2, 1.0): ["tiny-wan"],
}


# the library's CPU paths (conftest.py), but for every family once through our kernels (norm, rotation) at degree 2
pytestmark = pytest.mark.cpu_paths


@pytest.mark.parametrize("world_size, name", [
    pytest.param(*case.values, id=case.id, marks=pytest.mark.kernels if case.values[0] == 2 else ())
    for case in per_pipeline(ULYSSES)])
def test_parallel_pipelines_match_single_process(world_size: int, name: str) -> None:
    # N = 2 runs every case; N = 3 and 4 each batch and each size once (uneven sizes with batch 2)
    run_on_ranks(world_size, pipeline_worker, name, 1, 3.0, "reference", False, world_size == 2)


@pytest.mark.parametrize("world_size, guidance, name", per_pipeline(CFG))
def test_cfg_parallel_matches_single_process(world_size: int, guidance: float, name: str) -> None:
    """cfg_degree=2: each CFG group runs one branch (guidance 1.0: no CFG, every group runs every call)."""
    run_on_ranks(world_size, pipeline_worker, name, 2, guidance, "reference", False, False)


@pytest.mark.parametrize("world_size, name", per_pipeline({2: ["tiny-wan", "tiny-hunyuan-video"],
                                                           3: ["tiny-flux", "tiny-sd3.5"]}))
def test_overlap_backend_matches_single_process(world_size: int, name: str) -> None:
    """backend="overlap": head chunks in flight while others compute (text first and last, text masks)."""
    run_on_ranks(world_size, pipeline_worker, name, 1, 3.0, "overlap")


# 4 x 1: experts split four ways; 2 x 2: two ways within each CFG group
@pytest.mark.parametrize("world_size, cfg_degree, name",
                         per_pipeline({(4, 1): ["tiny-nucleusmoe", "tiny-hidream"],
                                       (4, 2): ["tiny-nucleusmoe", "tiny-hidream"]}))
def test_expert_parallel_matches_single_process(world_size: int, cfg_degree: int, name: str) -> None:
    """expert_parallel=True: each rank of a Ulysses group holds E/N experts (NucleusMoE's 8 by expert choice,
    HiDream's 4 by top-2 token choice), computes their share of the group's tokens and the ranks sum each token's
    contributions; `disable` brings every expert back."""
    run_on_ranks(world_size, pipeline_worker, name, cfg_degree, 3.0, "reference", True)


def _bare_transformer_worker(name: str) -> None:
    model = zoo.build_pipeline(name).transformer
    inputs = bare_transformer_inputs(name, torch.Generator().manual_seed(3))
    ref = model(**inputs).sample
    assert xstage_dit.enable(model, timeout_s=120) is model
    out = model(**inputs).sample
    error = relative_error(out, ref)
    assert error < TOLERANCE, f"bare {name} transformer: relative error {error:.2e}"


@pytest.mark.parametrize("name, world_size", [("tiny-flux", 3), ("tiny-ltx", 2)])
def test_bare_transformer_matches_single_process(name: str, world_size: int) -> None:
    run_on_ranks(world_size, _bare_transformer_worker, name)


def _hunyuan_video15_worker() -> None:
    """35 video tokens (5 frames x 1 x 7), padded prompts of two lengths, text-to-video (zero image embeds)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    from xstage_dit.patches.video.hunyuan_video15 import KeyPaddingProcessor

    torch.manual_seed(0)
    model = HunyuanVideo15Transformer3DModel(**zoo.ZOO["tiny-hunyuan-video15"].transformer).eval()
    generator = torch.Generator().manual_seed(4)
    mask, mask_2 = torch.ones(2, 6, dtype=torch.long), torch.ones(2, 4, dtype=torch.long)
    mask[1, 3:], mask_2[0, 2:] = 0, 0
    inputs = dict(hidden_states=torch.randn(2, 9, 5, 1, 7, generator=generator), timestep=torch.tensor([500.0, 500.0]),
                  encoder_hidden_states=torch.randn(2, 6, 32, generator=generator), encoder_attention_mask=mask,
                  encoder_hidden_states_2=torch.randn(2, 4, 24, generator=generator),
                  encoder_attention_mask_2=mask_2, image_embeds=torch.zeros(2, 3, 16))
    with torch.no_grad():
        ref = model(**inputs).sample
        xstage_dit.enable(model, timeout_s=120)
        processors = {type(block.attn.processor) for block in model.transformer_blocks}
        out = model(**inputs).sample
        xstage_dit.disable(model)
        again = model(**inputs).sample
    assert processors == {KeyPaddingProcessor}, processors
    error = relative_error(out, ref)
    assert error < TOLERANCE, f"HunyuanVideo 1.5 transformer: relative error {error:.2e}"
    assert torch.equal(again, ref), "disable did not restore the model"
    assert {type(block.attn.processor).__name__ for block in model.transformer_blocks} == {
        "HunyuanVideo15AttnProcessor2_0"}


def _hunyuan_video_token_replace_worker() -> None:
    """Image-to-video by token replacement: 2 frames x 4 x 5 video tokens, the first frame's 20 modulated apart (at
    N = 3 ranks hold 14, 6 and none of them), batch 2 with prompts padded differently."""
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(0)
    model = HunyuanVideoTransformer3DModel(**zoo.ZOO["tiny-hunyuan-video"].transformer,
                                           image_condition_type="token_replace").eval()
    generator = torch.Generator().manual_seed(6)
    mask = torch.ones(2, 6)
    mask[1, 4:] = 0
    inputs = dict(hidden_states=torch.randn(2, 4, 2, 8, 10, generator=generator),
                  timestep=torch.tensor([500, 300]), encoder_hidden_states=torch.randn(2, 6, 32, generator=generator),
                  encoder_attention_mask=mask, pooled_projections=torch.randn(2, 24, generator=generator),
                  guidance=torch.tensor([3000.0, 3000.0]))
    with torch.no_grad():
        ref = model(**inputs).sample
        xstage_dit.enable(model, timeout_s=120)
        out = model(**inputs).sample
        xstage_dit.disable(model)
        again = model(**inputs).sample
    error = relative_error(out, ref)
    assert error < TOLERANCE, f"HunyuanVideo token_replace transformer: relative error {error:.2e}"
    assert torch.equal(again, ref), "disable did not restore the model"


@pytest.mark.parametrize("world_size", [2, 3])
def test_hunyuan_video_token_replace_matches_single_process(world_size: int) -> None:
    """Each rank's blocks modulate the first frame's tokens it holds, as one process does the whole frame's."""
    run_on_ranks(world_size, _hunyuan_video_token_replace_worker)


def _ltx2_worker() -> None:
    """35 video tokens (5 frames x 1 x 7) and 11 audio tokens, batch 2 with prompts padded differently; per-sample
    timesteps, per-token video timesteps (image-to-video's) with per-sample audio ones, and spatio-temporal
    guidance perturbing block 1 for one sample (the pipelines' default guidance)."""
    from diffusers import LTX2VideoTransformer3DModel

    torch.manual_seed(0)
    model = LTX2VideoTransformer3DModel(**LTX2_CONFIG).eval()
    generator = torch.Generator().manual_seed(5)
    mask = torch.ones(2, 6)
    mask[1, 4:] = 0
    inputs = dict(hidden_states=torch.randn(2, 35, 8, generator=generator),
                  audio_hidden_states=torch.randn(2, 11, 8, generator=generator),
                  encoder_hidden_states=torch.randn(2, 6, 32, generator=generator),
                  audio_encoder_hidden_states=torch.randn(2, 6, 32, generator=generator),
                  timestep=torch.tensor([500.0, 300.0]), sigma=torch.tensor([0.5, 0.3]),
                  encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
                  num_frames=5, height=1, width=7, audio_num_frames=11)
    cases = {"per-sample": inputs,
             "per-token": dict(inputs, timestep=torch.rand(2, 35, generator=generator) * 1000,
                               audio_timestep=torch.tensor([500.0, 300.0])),
             "perturbed": dict(inputs, spatio_temporal_guidance_blocks=[1], perturbation_mask=torch.tensor([0.0, 1.0]))}
    with torch.no_grad():
        refs = [model(**case) for case in cases.values()]
        xstage_dit.enable(model, timeout_s=120)
        outs = [model(**case) for case in cases.values()]
        xstage_dit.disable(model)
        again = model(**inputs)
    for name, out, ref in zip(cases, outs, refs):
        for stream in ("sample", "audio_sample"):
            error = relative_error(getattr(out, stream), getattr(ref, stream))
            assert error < TOLERANCE, f"LTX-2 {name} timesteps, {stream}: relative error {error:.2e}"
    assert torch.equal(again.sample, refs[0].sample), "disable did not restore the model"


@pytest.mark.parametrize("world_size", [2, 3])
def test_ltx2_transformer_matches_single_process(world_size: int) -> None:
    """Video split (Ulysses self-attention), audio whole on every rank, video-to-audio over gathered video keys."""
    run_on_ranks(world_size, _ltx2_worker)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_hunyuan_video15_transformer_matches_single_process(world_size: int) -> None:
    """Its blocks attend with the prompt's key-padding mask, not diffusers' (queries x keys) outer product."""
    run_on_ranks(world_size, _hunyuan_video15_worker)


def _no_guidance_worker() -> None:
    name = "tiny-wan"
    pipe = zoo.build_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    xstage_dit.enable(pipe, cfg_degree=2, timeout_s=120)
    kwargs = zoo.call_kwargs(name, **SIZES[name]["even"], steps=1, guidance=1.0)
    with xstage_warnings() as warnings:
        for _ in range(2):
            pipe(**kwargs, **zoo.text_embeddings(name, 1, seed=3), output_type="latent", return_dict=False)
    said = [w for w in warnings if "turn classifier-free guidance off" in w]
    assert len(said) == 1 and "WanPipeline" in said[0], warnings


def test_cfg_degree_2_says_once_that_calls_without_guidance_run_on_every_group() -> None:
    """A pipeline calling its transformer once per branch, called with guidance off: both CFG groups compute
    every call (equal to one process: test_cfg_parallel_matches_single_process), said once."""
    run_on_ranks(2, _no_guidance_worker)


def _from_pipe_worker() -> None:
    """A pipeline made by from_pipe shares the enabled transformer: called as it is, it warns once that the CFG
    split is off (and still equals one process); enabled with the same arguments it splits the branches;
    other arguments are refused."""
    import diffusers

    name = "tiny-wan"
    pipe = zoo.build_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    kwargs = zoo.call_kwargs(name, **SIZES[name]["even"], steps=2, guidance=3.0)
    block_calls = []
    pipe.transformer.blocks[0].register_forward_pre_hook(lambda module, args: block_calls.append(1))

    def generate(target) -> tuple[torch.Tensor, int]:
        block_calls.clear()
        out = target(**kwargs, **zoo.text_embeddings(name, 1, seed=3), output_type="latent",
                     generator=torch.Generator().manual_seed(5), return_dict=False)[0]
        return out, len(block_calls)

    stock, stock_calls = generate(pipe)  # 2 steps x 2 branches
    xstage_dit.enable(pipe, cfg_degree=2, timeout_s=120)
    other = diffusers.WanPipeline.from_pipe(pipe)
    other.set_progress_bar_config(disable=True)
    with xstage_warnings() as warnings:
        out, calls = generate(other)
    assert relative_error(out, stock) < TOLERANCE and calls == stock_calls
    assert any("outside the pipeline that enable wrapped" in w for w in warnings), warnings
    with pytest.raises(RuntimeError, match="enable it with the same arguments"):
        xstage_dit.enable(other, cfg_degree=2, timeout_s=60)
    xstage_dit.enable(other, cfg_degree=2, timeout_s=120)
    out, calls = generate(other)
    assert relative_error(out, stock) < TOLERANCE and calls == stock_calls // 2, (calls, stock_calls)
    with pytest.raises(RuntimeError, match="already called"):
        xstage_dit.enable(other, cfg_degree=2, timeout_s=120)
    xstage_dit.disable(pipe)
    assert torch.equal(generate(other)[0], stock)


def test_from_pipe_shares_the_cfg_split_once_enabled() -> None:
    run_on_ranks(2, _from_pipe_worker)


def _attention_backend_worker() -> None:
    """The attention backend set on the model (set_attention_backend) attends the gathered heads inside Ulysses,
    and the result still equals one process."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    name = "tiny-flux"
    pipe = zoo.build_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    generate = seeded_latents(pipe, name, "uneven", steps=2, guidance=3.0, text_seed=4, noise_seed=6)
    stock = generate()
    math_backend = AttentionBackendName._NATIVE_MATH
    original = _AttentionBackendRegistry._backends[math_backend]
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs["query"].shape)
        return original(*args, **kwargs)

    _AttentionBackendRegistry._backends[math_backend] = counted
    pipe.transformer.set_attention_backend("_native_math")
    xstage_dit.enable(pipe, backend="reference", timeout_s=120)
    out = generate()
    assert relative_error(out, stock) < TOLERANCE
    # every routed call attended the gathered heads (the whole sequence, half the heads) with it
    heads = zoo.ZOO[name].transformer["num_attention_heads"]
    assert calls and all(shape[2] == heads // 2 for shape in calls), calls[:3]


def test_the_models_attention_backend_attends_inside_ulysses() -> None:
    run_on_ranks(2, _attention_backend_worker)


def _first_block_cache_worker(name: str, size: str) -> None:
    """diffusers' FirstBlockCache decides over the whole sequence on every rank: with a threshold between what
    the ranks' shards alone give at its first comparison (there one rank alone would skip the remaining blocks
    and another compute them, leaving collectives unmatched), the parallel result equals one process's."""
    from diffusers.hooks import FirstBlockCacheConfig

    pipe = zoo.build_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    # guidance off: one transformer call per step, so consecutive head-block calls are the ones the cache compares
    generate = seeded_latents(pipe, name, size, steps=6, guidance=1.0)
    xstage_dit.enable(pipe, backend="reference", timeout_s=30)
    statistics = local_statistics(pipe, generate).alone
    xstage_dit.disable(pipe)
    # the first comparison: before it nothing was skipped, so there a rank alone would decide as recorded
    lowest, highest = min(statistics[0]), max(statistics[0])
    threshold = (lowest + highest) / 2
    assert lowest < threshold < highest

    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    stock = generate()
    xstage_dit.enable(pipe, backend="reference", timeout_s=30)
    out = generate()
    error = relative_error(out, stock)
    assert error < TOLERANCE, f"{name}, threshold {threshold:.4f} ({statistics}): relative error {error:.2e}"


def _first_block_cache_cfg_worker() -> None:
    """With the CFG split halving a batched call (CogVideoX, cfg_degree=2), FirstBlockCache decides on the whole
    batch: with a threshold between the whole batch's statistic at its first comparison and one half's (there one
    CFG group alone would compute the remaining blocks and the other skip them), the result equals one process's."""
    from diffusers.hooks import FirstBlockCacheConfig

    name = "tiny-cogvideox"
    pipe = zoo.build_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    generate = seeded_latents(pipe, name, "even", steps=4, guidance=3.0)
    block = pipe.transformer.transformer_blocks[0]
    residuals = []
    handle = block.register_forward_hook(
        lambda module, args, kwargs, output: residuals.append((output[0] - kwargs["hidden_states"]).detach()),
        with_kwargs=True)
    uncached = generate()
    handle.remove()
    previous, current = residuals[0], residuals[1]  # batch [unconditional, conditional]

    def ratio(rows: slice) -> float:
        return ((current[rows] - previous[rows]).abs().sum() / previous[rows].abs().sum()).item()

    whole = ratio(slice(None))
    above = min(half for half in (ratio(slice(0, 1)), ratio(slice(1, 2))) if half > whole)
    assert above > whole * (1 + 1e-4), (whole, above)
    threshold = (whole + above) / 2
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    stock = generate()
    assert not torch.equal(stock, uncached), "FirstBlockCache skipped nothing"
    xstage_dit.enable(pipe, backend="reference", timeout_s=30, cfg_degree=2)
    out = generate()
    error = relative_error(out, stock)
    assert error < TOLERANCE, f"{name}, cfg_degree=2, threshold {threshold:.4f}: relative error {error:.2e}"


def test_first_block_cache_decides_on_the_whole_batch_under_the_cfg_split() -> None:
    run_on_ranks(2, _first_block_cache_cfg_worker)


def _cache_configs(pipe, steps: int) -> dict[str, list]:
    """diffusers' other cache configs, each on a family it acts on (checked: the cached result differs)."""
    from diffusers import (FasterCacheConfig, MagCacheConfig, PyramidAttentionBroadcastConfig, SeaCacheConfig,
                           TaylorSeerCacheConfig)

    every_step = (-1, 1001)
    return {
        "tiny-flux": [
            TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1),
            PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=2,
                                            spatial_attention_timestep_skip_range=every_step,
                                            current_timestep_callback=lambda: pipe.current_timestep),
            MagCacheConfig(threshold=0.5, num_inference_steps=steps, mag_ratios=[1.0] + [0.98] * (steps - 1)),
        ],
        "tiny-wan": [SeaCacheConfig(threshold=1.0)],
        "tiny-cogvideox": [  # its home: guidance batched with the conditional branch
            FasterCacheConfig(spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=every_step,
                              unconditional_batch_skip_range=2, unconditional_batch_timestep_skip_range=every_step,
                              current_timestep_callback=lambda: pipe.current_timestep, tensor_format="BFCHW"),
        ],
    }


def _cache_configs_worker() -> None:
    """Each cache enabled before xstage_dit (so its hooks already wrap the attention modules' forwards) and after
    it: the parallel result equals one process's with the same cache."""
    steps = 6
    for name, guidance in (("tiny-flux", 1.0), ("tiny-wan", 1.0), ("tiny-cogvideox", 3.0)):
        pipe = zoo.build_pipeline(name)
        pipe.set_progress_bar_config(disable=True)
        generate = seeded_latents(pipe, name, "uneven", steps=steps, guidance=guidance)
        uncached = generate()
        for index, config in enumerate(_cache_configs(pipe, steps)[name]):
            pipe.transformer.enable_cache(config)
            stock = generate()
            assert not torch.equal(stock, uncached), f"{name}: {type(config).__name__} changed nothing"
            xstage_dit.enable(pipe, backend="reference", timeout_s=60)
            before = generate()
            xstage_dit.disable(pipe)
            pipe.transformer.disable_cache()
            xstage_dit.enable(pipe, backend="reference", timeout_s=60)
            pipe.transformer.enable_cache(_cache_configs(pipe, steps)[name][index])  # a config holds its state
            after = generate()
            pipe.transformer.disable_cache()
            xstage_dit.disable(pipe)
            for order, out in (("before", before), ("after", after)):
                error = relative_error(out, stock)
                assert error < TOLERANCE, (f"{name}, {type(config).__name__} enabled {order} xstage_dit: relative "
                                           f"error {error:.2e}")


@pytest.mark.parametrize("world_size", [2, 3])  # Flux's 8 prompt tokens: split over 2 ranks, whole over 3
def test_other_cache_configs_equal_one_process(world_size: int) -> None:
    run_on_ranks(world_size, _cache_configs_worker)


# "even": no padding, so each rank alone would decide on exactly the recorded statistic; "uneven": the shared
# decision leaves the padding rows out
@pytest.mark.parametrize("name, world_size, size", [("tiny-flux", 2, "even"), ("tiny-flux", 3, "uneven"),
                                                     ("tiny-wan", 2, "even")])
def test_first_block_cache_decides_as_one_process(name: str, world_size: int, size: str) -> None:
    run_on_ranks(world_size, _first_block_cache_worker, name, size)


def _qwenimage21_worker() -> None:
    """Target images of 40 tokens (uneven at 3 ranks) and 36, each without a KV cache and with the pipeline's two
    cached calls (the first step prefills the prefix's keys and values, the next computes the target alone)."""
    from diffusers import QwenImage21Transformer2DModel
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    torch.manual_seed(0)
    model = QwenImage21Transformer2DModel(**QWENIMAGE21_CONFIG).eval()
    generator = torch.Generator().manual_seed(5)
    cases = {(h, w): qwenimage21_inputs(h, w, generator) for h, w in ((4, 10), (6, 6))}

    def run() -> dict:
        outs = {}
        for size, inputs in cases.items():
            cache = QwenImage21KVCache(len(model.transformer_blocks))
            outs[size] = [model(**inputs)[0],
                          model(**inputs, kv_cache=cache, kv_cache_mode="extract")[0],
                          model(**dict(inputs, timestep=torch.tensor([0.3, 0.2])), kv_cache=cache,
                                kv_cache_mode="cached")[0]]
        return outs

    with torch.no_grad():
        refs = run()
        xstage_dit.enable(model, timeout_s=120)
        rows: list[int] = []  # what reaches the second block: the prefix (15 tokens) and this rank's target share
        hook = model.transformer_blocks[1].register_forward_pre_hook(
            lambda module, args, kwargs: rows.append(kwargs["hidden_states"].shape[1]), with_kwargs=True)
        outs = run()
        hook.remove()
        xstage_dit.disable(model)
    share = {(h, w): math.ceil(h * w / torch.distributed.get_world_size()) for h, w in cases}
    assert rows == [n for size in cases for n in (15 + share[size], 15 + share[size], share[size])], rows
    for size in cases:
        for mode, out, ref in zip(("no cache", "prefill", "cached"), outs[size], refs[size]):
            assert out.shape == ref.shape, f"Qwen-Image 2.1 {size} {mode}: shape {tuple(out.shape)}"
            error = relative_error(out, ref)
            assert error < TOLERANCE, f"Qwen-Image 2.1 {size} {mode}: relative error {error:.2e}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_qwenimage21_transformer_matches_single_process(world_size: int) -> None:
    """Target image split, the block-causal prefix (prompt and condition image) whole on every rank, with and
    without its KV cache."""
    run_on_ranks(world_size, _qwenimage21_worker)
