"""The public API in one process: argument checks that must fail before any collective, and exact restore."""
from __future__ import annotations

import functools
import logging

import diffusers
import pytest
import torch
from diffusers.models.transformers import transformer_flux

import xstage_dit
from xstage_dit.testing import zoo
from dist_harness import run_on_ranks
from xstage_dit import api
from xstage_dit.hooks.module_forward import ReplacedForward
from xstage_dit.patches.image.flux import NormRopeProcessor
from xstage_dit.runtime.cuda_graphs import GraphUse
from xstage_dit.sp.attention import ops, routing
from xstage_dit.sp.sharding import SequenceShard


@pytest.fixture(scope="module")
def flux_pipe():
    return zoo.build_pipeline("tiny-flux")


def _latents(pipe, steps: int) -> torch.Tensor:
    """The tiny Flux pipeline's latents for a fixed prompt embedding and seed."""
    kwargs = zoo.call_kwargs("tiny-flux", height=20, width=28, num_frames=1, steps=steps, guidance=2.0)
    return pipe(**kwargs, **zoo.text_embeddings("tiny-flux", 1, seed=0), output_type="latent",
                generator=torch.Generator().manual_seed(0), return_dict=False)[0]


@pytest.fixture
def world(monkeypatch):
    """Pretend to be rank 0 of a launched job without starting a group: every check must fail before one."""
    def set_world(size: int) -> None:
        monkeypatch.setenv("WORLD_SIZE", str(size))
        monkeypatch.setenv("RANK", "0")
    return set_world


def test_cuda_graph_use_needs_an_enabled_pipeline_and_counts_nothing_without_graphs(flux_pipe):
    with pytest.raises(ValueError, match="enable"):
        xstage_dit.cuda_graph_use(flux_pipe)
    xstage_dit.enable(flux_pipe, cuda_graphs=False)
    try:
        _latents(flux_pipe, steps=2)
        assert xstage_dit.cuda_graph_use(flux_pipe) == GraphUse(replays=0, other_calls=0)
    finally:
        xstage_dit.disable(flux_pipe)


def test_unsupported_pipeline_is_refused():
    with pytest.raises(TypeError, match="expects a diffusers pipeline"):
        xstage_dit.enable(object())


def test_unsupported_transformer_names_supported_families():
    model = diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=1,
                                            sample_size=8, norm_num_groups=4)
    with pytest.raises(TypeError, match=r"no sequence-parallel patch for DiTTransformer2DModel; supported: "
                                        r"Chroma .*CogVideoX .*HiDream .*Wan"):
        xstage_dit.enable(model)


def test_a_one_process_accelerate_launch_is_said_once(flux_pipe, monkeypatch, caplog):
    """accelerate's one-process launcher (`accelerate launch --num_processes 2` without --multi_gpu) sets
    ACCELERATE_USE_CPU and no WORLD_SIZE: the unsplit run is said, with the flag that splits it."""
    from xstage_dit.logging_utils import fresh_warnings

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    with fresh_warnings(), caplog.at_level(logging.WARNING, logger="xstage_dit"):
        for _ in range(2):
            xstage_dit.enable(flux_pipe)
            xstage_dit.disable(flux_pipe)
    said = [r.getMessage() for r in caplog.records if "accelerate launch" in r.getMessage()]
    assert said == ["xstage_dit: `accelerate launch` started one process, so the model runs unsplit; it starts "
                    "several only with --multi_gpu (`accelerate launch --multi_gpu --num_processes N`, on CPUs too)"]


def test_a_model_compiled_before_enable_says_to_compile_after(flux_pipe):
    transformer = flux_pipe.transformer
    flux_pipe.transformer = torch.compile(transformer)
    message = (r"xstage_dit.enable: {} is a torch.compile'd FluxTransformer2DModel; call xstage_dit.enable first, or "
               r"compile after it")
    try:
        with pytest.raises(TypeError, match=message.format("pipe.transformer")):
            xstage_dit.enable(flux_pipe)
        with pytest.raises(TypeError, match=message.format("the model")):
            xstage_dit.enable(flux_pipe.transformer)
    finally:
        flux_pipe.transformer = transformer
    assert not xstage_dit.installed_layers(flux_pipe)


@pytest.mark.parametrize("size, kwargs, message", [
    (8, {"ulysses_degree": 8}, r"12 attention heads, which ulysses_degree=8 cannot split; over these 8 ranks these "
                               r"work: ulysses_degree=1 x ring_degree=8, ulysses_degree=2 x ring_degree=4, "
                               r"ulysses_degree=4 x ring_degree=2$"),
    (5, {"ulysses_degree": 5}, r"12 attention heads.*these work: ulysses_degree=1 x ring_degree=5$"),
    (10, {"ulysses_degree": 5, "cfg_degree": 2}, r"which ulysses_degree=5 cannot split; over these 5 ranks these "
                                                 r"work: ulysses_degree=1 x ring_degree=5$"),
])
def test_heads_that_cannot_be_split_name_working_splits(flux_pipe, world, size, kwargs, message):
    world(size)  # tiny-flux has 12 heads
    with pytest.raises(ValueError, match=message):
        xstage_dit.enable(flux_pipe, **kwargs)


def test_z_image_heads_name_the_degrees_they_allow(world):
    """Z-Image's 30 heads (its own config key, `n_heads`): 4 ranks split them as Ulysses 2 x ring 2, not 4."""
    world(4)
    model = diffusers.ZImageTransformer2DModel(dim=30 * 16, n_heads=30, n_kv_heads=30, n_layers=1,
                                               n_refiner_layers=1, in_channels=4, cap_feat_dim=32,
                                               axes_dims=[4, 6, 6])
    with pytest.raises(ValueError, match=r"30 attention heads, .* these work: ulysses_degree=1 x ring_degree=4, "
                                         r"ulysses_degree=2 x ring_degree=2$"):
        xstage_dit.enable(model, ulysses_degree=4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"cfg_degree": 4}, "cfg_degree must be 1 or 2"),
        ({"cfg_degree": 0}, "cfg_degree must be 1 or 2"),
        ({"ulysses_degree": 8}, r"ulysses_degree=8 does not fit the world size 4: .* so it must divide 4$"),
        ({"ulysses_degree": 4, "cfg_degree": 2}, r"ulysses_degree=4 does not fit the world size 4 with cfg_degree=2"),
        ({"backend": "nope"}, "unknown xstage_dit backend 'nope'"),
        ({"backend": "fused"}, "backend 'fused' needs CUDA GPUs"),
        ({"ulysses_degree": 0}, r"ulysses_degree must be None or an int >= 1, got 0"),
        ({"ring_degree": -2}, r"ring_degree must be None or an int >= 1, got -2"),
        ({"timeout_s": 0}, "timeout_s must be a positive number of seconds, got 0"),
        ({"timeout_s": float("nan")}, "timeout_s must be a positive number of seconds, got nan"),
        ({"timeout_s": float("inf")}, "timeout_s must be a positive number"),
        ({"cuda_graphs": True}, "cuda_graphs=True needs a GPU; this rank runs on cpu"),
        ({"expert_parallel": True}, "FluxTransformer2DModel has no mixture-of-experts layers that xstage_dit can "
                                    "shard"),
    ],
)
def test_bad_degrees_and_backends(flux_pipe, world, kwargs, message):
    world(4)
    with pytest.raises(ValueError, match=message):
        xstage_dit.enable(flux_pipe, **kwargs)
    assert not torch.distributed.is_initialized()


def test_a_cache_enabled_while_enabled_keeps_working_after_disable(flux_pipe):
    """A diffusers hook registered on a marked attention module captures the marked class's forward."""
    from diffusers import PyramidAttentionBroadcastConfig

    def cache() -> PyramidAttentionBroadcastConfig:
        return PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=2,
                                               spatial_attention_timestep_skip_range=(-1, 1001),
                                               current_timestep_callback=lambda: flux_pipe.current_timestep)

    def generate() -> torch.Tensor:
        return flux_pipe(**zoo.call_kwargs("tiny-flux", height=24, width=32, num_frames=1, steps=3, guidance=1.0),
                         **zoo.text_embeddings("tiny-flux", 1, seed=2), output_type="latent",
                         generator=torch.Generator().manual_seed(8), return_dict=False)[0]

    xstage_dit.enable(flux_pipe)
    flux_pipe.transformer.enable_cache(cache())
    generate()
    xstage_dit.disable(flux_pipe)
    after = generate()
    flux_pipe.transformer.disable_cache()
    flux_pipe.transformer.enable_cache(cache())
    assert torch.equal(after, generate())
    flux_pipe.transformer.disable_cache()


def test_a_forward_wrapped_after_enable_survives_disable(flux_pipe):
    """An attention module with an instance forward before enable (accelerate's hooks, a cache's registry) that
    someone wraps again while enabled keeps that wrapper after disable, and it still computes the stock result."""
    attention = flux_pipe.transformer.transformer_blocks[0].attn
    stock = _latents(flux_pipe, steps=2)
    before = attention.forward
    attention.forward = functools.partial(before)
    xstage_dit.enable(flux_pipe)
    calls = []
    enabled_forward = attention.forward

    def counting(*args, **kwargs):
        calls.append(1)
        return enabled_forward(*args, **kwargs)

    attention.forward = counting
    xstage_dit.disable(flux_pipe)
    try:
        assert attention.forward is counting
        assert torch.equal(_latents(flux_pipe, steps=2), stock) and calls
    finally:
        del attention.forward


def test_parallel_vae_where_there_is_none_to_split_is_refused(flux_pipe, world):
    world(2)
    with pytest.raises(ValueError, match=r"parallel_vae=True: this pipeline has no VAE; the decode can be split for "
                                         r"AutoencoderKL, AutoencoderKLHunyuanVideo"):
        xstage_dit.enable(flux_pipe.transformer, parallel_vae=True)
    cogvideox = zoo.build_pipeline("tiny-cogvideox")
    with pytest.raises(ValueError, match="parallel_vae=True: AutoencoderKLCogVideoX has no parallel decode"):
        xstage_dit.enable(cogvideox, parallel_vae=True)
    assert not torch.distributed.is_initialized()


def test_cfg_degree_that_does_not_divide_the_world_names_only_what_was_given(flux_pipe, world):
    world(3)
    with pytest.raises(ValueError, match=r"^cfg_degree=2 does not divide the world size 3$"):
        xstage_dit.enable(flux_pipe, cfg_degree=2)


@pytest.mark.parametrize("kwargs, message", [
    ({"ulysses_degree": "2"}, r"ulysses_degree must be None or an int >= 1, got '2'"),
    ({"ulysses_degree": 2.0}, r"ulysses_degree must be None or an int >= 1, got 2.0"),
    ({"ulysses_degree": True}, r"ulysses_degree must be None or an int >= 1, got True"),
    ({"ring_degree": 1.5}, r"ring_degree must be None or an int >= 1, got 1.5"),
    ({"cfg_degree": "2"}, r"cfg_degree must be 1 or 2 \(guidance has two branches\), got '2'"),
    ({"timeout_s": "60"}, r"timeout_s must be a positive number of seconds, got '60'"),
    ({"timeout_s": True}, r"timeout_s must be a positive number of seconds, got True"),
    ({"backend": None}, r"backend must be the name of a backend \(one of xstage_dit.available_backends\(\)\), "
                        r"got None"),
    ({"fuse_rope": "yes"}, r"fuse_rope must be True or False, got 'yes'"),
    ({"fuse_mlp": None}, r"fuse_mlp must be True or False, got None"),
    ({"cuda_graphs": 1}, r"cuda_graphs must be None \(on where there is a GPU\), True or False, got 1"),
    ({"parallel_vae": "yes"}, r"parallel_vae must be None \(on where supported\), True or False, got 'yes'"),
    ({"expert_parallel": 1}, r"expert_parallel must be None \(chosen per layer call\), True or False, got 1"),
])
def test_arguments_of_the_wrong_type_are_named(flux_pipe, world, kwargs, message):
    world(4)
    with pytest.raises(TypeError, match=message):
        xstage_dit.enable(flux_pipe, **kwargs)
    assert not torch.distributed.is_initialized()


def test_a_config_checks_itself_as_it_is_made():
    """The same checks as enable's keywords, where the record is made (no job needed)."""
    with pytest.raises(TypeError, match=r"fuse_rope must be True or False, got 'yes'"):
        xstage_dit.XStageConfig(fuse_rope="yes")
    with pytest.raises(ValueError, match=r"timeout_s must be a positive number of seconds, got -1"):
        xstage_dit.XStageConfig(timeout_s=-1)
    with pytest.raises(ValueError, match=r"cfg_degree must be 1 or 2 \(guidance has two branches\), got 3"):
        xstage_dit.XStageConfig(cfg_degree=3)


def test_the_fp8_knob_reads_as_the_parts_in_one_order_and_refuses_others_in_words():
    """`fp8` takes None, "all", a part's name or several, kept as a tuple in FP8_PARTS' order (so that ranks that
    were given the same parts in another order agree); `fp8_full_precision_steps` is a step count."""
    config = xstage_dit.XStageConfig
    assert config().fp8 == () and config(fp8=()).fp8 == ()
    assert config(fp8="all").fp8 == ("attention", "linear", "payloads")
    assert config(fp8=["payloads", "attention"]) == config(fp8=("attention", "payloads"))
    assert config(fp8="linear").fp8 == ("linear",)
    for bad in ("fp16", 3, ["attention", "payload"]):
        with pytest.raises(ValueError, match=r"fp8 must be None, \"all\" or parts among 'attention', 'linear', "
                                             r"'payloads', got"):
            config(fp8=bad)
    with pytest.raises(ValueError, match=r"fp8_full_precision_steps must be an int >= 0, got -1"):
        config(fp8_full_precision_steps=-1)
    for bad in (True, 1.0):
        with pytest.raises(TypeError, match=r"fp8_full_precision_steps must be an int >= 0"):
            config(fp8_full_precision_steps=bad)


@pytest.mark.parametrize("fp8, backend", [("payloads", "reference"), (("attention", "payloads"), "overlap")])
def test_fp8_payloads_without_a_backend_that_sends_them_are_refused_before_any_collective(flux_pipe, world, fp8,
                                                                                          backend):
    """FP8 payloads are taken where the backend may pick the fused strategy (tests/test_fp8_payloads.py); a backend
    whose exchanges send the model's dtype is refused in words, FP8 attention or not."""
    world(2)
    with pytest.raises(ValueError, match=rf"fp8=\"payloads\": backend '{backend}' sends no FP8 payloads; the fused "
                                         r"backend's stores do"):
        xstage_dit.enable(flux_pipe, fp8=fp8, backend=backend)
    assert not torch.distributed.is_initialized()


def test_enable_takes_a_config_whole_or_its_knobs_as_keywords(flux_pipe, world):
    """`enable(pipe, knob=v)` is `enable(pipe, config=XStageConfig(knob=v))`; keywords replace a config's fields;
    an unknown keyword names the knobs."""
    world(3)
    message = r"cfg_degree=2 does not divide the world size 3"
    with pytest.raises(ValueError, match=message):
        xstage_dit.enable(flux_pipe, config=xstage_dit.XStageConfig(cfg_degree=2))
    with pytest.raises(ValueError, match=message):
        xstage_dit.enable(flux_pipe, config=xstage_dit.XStageConfig(), cfg_degree=2)
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) ulysses; its knobs are ulysses_degree, ring_degree, cfg_degree"):
        xstage_dit.enable(flux_pipe, ulysses=2)
    with pytest.raises(TypeError, match=r"config must be an xstage_dit.XStageConfig, got dict"):
        xstage_dit.enable(flux_pipe, config={"cfg_degree": 2})
    assert not torch.distributed.is_initialized()


def test_the_ranks_compare_every_knob(flux_pipe):
    """The agreement fingerprint at enable is made from the config's fields: a new knob cannot be left out."""
    config = xstage_dit.XStageConfig(ulysses_degree=1)
    names = api._fingerprint([flux_pipe.transformer], config).names
    assert names[:len(config.knobs())] == list(config.knobs())


@pytest.mark.parametrize("size, message", [
    (3, r"8 experts do not split over a Ulysses degree of 3; degrees that divide them: \[2, 4, 8\]"),
    (1, "it needs a Ulysses degree above 1"),
])
def test_experts_that_cannot_be_sharded_are_refused(world, size, message):
    world(size)
    with pytest.raises(ValueError, match=message):
        xstage_dit.enable(zoo.build_pipeline("tiny-nucleusmoe"), expert_parallel=True)
    assert not torch.distributed.is_initialized()


def test_enable_twice_is_refused_and_disable_restores_exactly(flux_pipe):
    model = flux_pipe.transformer
    original_dispatch = transformer_flux.dispatch_attention_fn
    original_rotary = transformer_flux.apply_rotary_emb
    attention = [block.attn for block in model.transformer_blocks]
    attention_class = type(attention[0])
    xstage_dit.enable(flux_pipe)
    try:
        assert transformer_flux.dispatch_attention_fn is not original_dispatch
        assert transformer_flux.apply_rotary_emb is not original_rotary
        assert all(type(a) is not attention_class and isinstance(a, attention_class) for a in attention)
        with pytest.raises(RuntimeError, match="already called"):
            xstage_dit.enable(flux_pipe)
    finally:
        xstage_dit.disable(flux_pipe)
    assert transformer_flux.dispatch_attention_fn is original_dispatch
    assert transformer_flux.apply_rotary_emb is original_rotary
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert all(type(a) is attention_class and not hasattr(a, "_xstage_attention") for a in attention)


def test_replaced_forwards_restore_what_was_there_in_any_stack():
    """The layers enable puts around a transformer's forward (CUDA graphs inside, the CFG split outside) each put
    back exactly what they replaced: the class's forward, or an instance attribute someone else set."""
    model = torch.nn.Linear(2, 2)
    theirs = model.forward  # e.g. a diffusers hook registry wraps forward as an instance attribute
    model.forward = theirs
    inner = ReplacedForward(model, lambda x: "inner")
    outer = ReplacedForward(model, lambda x: "outer")
    assert inner.inner is theirs and outer.inner(0) == "inner" and model(0) == "outer"
    outer.restore()
    inner.restore()
    assert model.__dict__["forward"] is theirs
    del model.forward
    bare = ReplacedForward(model, lambda x: "new")
    bare.restore()
    assert "forward" not in model.__dict__


def test_single_process_output_is_unchanged(flux_pipe):
    stock = _latents(flux_pipe, steps=2)
    xstage_dit.enable(flux_pipe)
    try:
        assert xstage_dit.is_main_process()
        torch.testing.assert_close(_latents(flux_pipe, steps=2), stock, rtol=1e-5, atol=1e-6)
    finally:
        xstage_dit.disable(flux_pipe)


# the tiny pipeline is on the CPU: the RoPE kernel runs there only in Triton's interpreter (conftest sets it
# where there is no GPU)
needs_interpreter = pytest.mark.skipif(not ops._TRITON_RUNS_ON_CPU, reason="needs Triton's CPU interpreter")


@needs_interpreter
@pytest.mark.parametrize("fuse_rope", [True, False])
def test_rope_runs_our_kernel_unless_asked_not_to(flux_pipe, monkeypatch, fuse_rope):
    """Every block's query and key are normalised and rotated by our norm + RoPE kernel (Flux's blocks run
    NormRopeProcessor): the output stays the stock one; `fuse_rope=False` leaves diffusers' processors and code in
    place (the rotary name is not even rebound)."""
    calls = []
    kernel = ops.norm_rope
    monkeypatch.setattr(ops, "norm_rope", lambda *args: calls.append(len(args[0])) or kernel(*args))
    stock = _latents(flux_pipe, steps=1)
    original_rotary = transformer_flux.apply_rotary_emb
    model = flux_pipe.transformer
    processors = [block.attn.processor for block in (*model.transformer_blocks, *model.single_transformer_blocks)]
    model_calls = []
    counter = model.register_forward_hook(lambda *_: model_calls.append(1))
    xstage_dit.enable(flux_pipe, fuse_rope=fuse_rope)
    try:
        assert (transformer_flux.apply_rotary_emb is original_rotary) is not fuse_rope
        assert all(isinstance(block.attn.processor, NormRopeProcessor) is fuse_rope
                   for block in (*model.transformer_blocks, *model.single_transformer_blocks))
        torch.testing.assert_close(_latents(flux_pipe, steps=1), stock, rtol=1e-5, atol=1e-6)
    finally:
        xstage_dit.disable(flux_pipe)
        counter.remove()
    assert [block.attn.processor for block in (*model.transformer_blocks, *model.single_transformer_blocks)] == \
        processors
    # query and key of every block in every model call: [text, image] in dual-stream blocks, joint in the others
    expected = ([2] * 2 * len(model.transformer_blocks) + [1] * 2 * len(model.single_transformer_blocks))
    assert calls == (expected * len(model_calls) if fuse_rope else [])


@needs_interpreter
@pytest.mark.parametrize("convention, table_dtype, warns", [
    ({"use_real_unbind_dim": -2}, torch.float32, False),  # halves instead of interleaved pairs
    ({}, torch.float64, True),  # tables the kernel does not take
])
def test_routed_rope_runs_diffusers_code_where_the_kernel_does_not_apply(flux_pipe, caplog, convention,
                                                                        table_dtype, warns):
    """Inside a routed module, rotations our kernel does not implement run diffusers' own code; inputs of the
    interleaved convention that it cannot take are said once."""
    x = torch.randn(1, 6, 2, 8)
    cos, sin = torch.randn(6, 8, dtype=table_dtype), torch.randn(6, 8, dtype=table_dtype)
    expected = transformer_flux.apply_rotary_emb(x, (cos, sin), sequence_dim=1, **convention)
    xstage_dit.enable(flux_pipe)
    try:
        routed = transformer_flux.apply_rotary_emb
        attention = flux_pipe.transformer.transformer_blocks[0].attn
        seen = []

        class RotateWhileActive:  # stands in for the module's processor, which runs while the module is active
            def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                         image_rotary_emb=None):
                seen.append((routing._active is not None, routed(x, (cos, sin), sequence_dim=1, **convention)))
                return hidden_states, encoder_hidden_states

        processor, attention.processor = attention.processor, RotateWhileActive()
        try:
            with caplog.at_level("WARNING", logger="xstage_dit"):
                attention(torch.randn(1, 6, attention.query_dim), torch.randn(1, 3, attention.query_dim))
        finally:
            attention.processor = processor
    finally:
        xstage_dit.disable(flux_pipe)
    active, out = seen[0]
    assert active
    torch.testing.assert_close(out, expected)
    assert ("RoPE kernel does not take" in caplog.text) is warns


@needs_interpreter
@pytest.mark.parametrize("tables", ["kernel", "float64", "none"])
@pytest.mark.parametrize("stream", ["dual", "single"])
def test_norm_rope_processor_equals_flux_processor(flux_pipe, caplog, tables, stream):
    """NormRopeProcessor gives diffusers' Flux attention on fresh inputs: through the kernel, through diffusers'
    steps where the kernel does not take the tables (said once), and without rotary tables."""
    torch.manual_seed(1)
    model = flux_pipe.transformer
    attn = (model.transformer_blocks if stream == "dual" else model.single_transformer_blocks)[0].attn
    for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        if (norm := getattr(attn, name, None)) is not None:
            torch.nn.init.normal_(norm.weight, 1.0, 0.3)  # not the ones they start at
    text, image = torch.randn(1, 5, attn.query_dim), torch.randn(1, 11, attn.query_dim)
    if stream == "dual":
        inputs = dict(hidden_states=image, encoder_hidden_states=text)
    else:
        inputs = dict(hidden_states=torch.cat([text, image], dim=1))
    angles = 10 * torch.rand(16, attn.head_dim, dtype=torch.float64 if tables == "float64" else torch.float32)
    rotary = None if tables == "none" else (angles.cos(), angles.sin())
    expected = transformer_flux.FluxAttnProcessor()(attn, **inputs, image_rotary_emb=rotary)
    with caplog.at_level("WARNING", logger="xstage_dit"):
        out = NormRopeProcessor(transformer_flux.FluxAttnProcessor())(attn, **inputs, image_rotary_emb=rotary)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert ("norm + RoPE kernel does not take" in caplog.text) is (tables == "float64")


@pytest.mark.parametrize("stream", ["dual", "single"])
def test_norm_rope_processor_follows_fused_projections(flux_pipe, stream):
    """After diffusers' `fuse_qkv_projections` (one to_qkv, and to_added_qkv where the module has text projections)
    NormRopeProcessor gives what diffusers' processor gives with the same fused projections."""
    torch.manual_seed(2)
    model = flux_pipe.transformer
    attn = (model.transformer_blocks if stream == "dual" else model.single_transformer_blocks)[0].attn
    text, image = torch.randn(1, 5, attn.query_dim), torch.randn(1, 11, attn.query_dim)
    inputs = (dict(hidden_states=image, encoder_hidden_states=text) if stream == "dual"
              else dict(hidden_states=torch.cat([text, image], dim=1)))
    angles = 10 * torch.rand(16, attn.head_dim)
    rotary = (angles.cos(), angles.sin())
    attn.fuse_projections()
    try:
        expected = transformer_flux.FluxAttnProcessor()(attn, **inputs, image_rotary_emb=rotary)
        out = NormRopeProcessor(transformer_flux.FluxAttnProcessor())(attn, **inputs, image_rotary_emb=rotary)
    finally:
        attn.unfuse_projections()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_refused_rope_inputs_compile_without_a_graph_break():
    """The refusal's one-time warning is not issued while a graph is traced (the compiler cannot trace logging):
    a fullgraph compile of the check goes through and falls back."""
    cos, sin = torch.randn(6, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)
    check = torch.compile(lambda x: ops.rotary_kernel_runs(x, cos, sin, 1), fullgraph=True, backend="eager")
    assert not check(torch.randn(1, 6, 2, 8))


@pytest.mark.parametrize("length, degree", [(12, 4), (35, 4), (5, 3), (2, 4)])
def test_shards_cover_the_sequence_in_order_with_tail_padding(length, degree):
    x = torch.arange(length * 2.0).reshape(1, length, 2)
    chunks = [SequenceShard(degree, rank, group=None).shard(x, dim=1) for rank in range(degree)]
    local = -(-length // degree)
    assert all(chunk.shape == (1, local, 2) for chunk in chunks)
    joined = torch.cat(chunks, dim=1)
    torch.testing.assert_close(joined[:, :length], x)
    assert not joined[:, length:].any()


@pytest.mark.parametrize("image, text, degree, splits", [
    (23, 8, 2, True),  # uneven image tokens: the last rank's padding is the sequence's tail
    (24, 8, 4, True),
    (23, 7, 2, False),  # unequal text shares
    (5, 8, 4, False),  # 2, 2, 1, 0 image tokens: rank 2's padding would sit before rank 3's text
])
def test_joint_text_splits_only_where_every_chunk_is_a_tail_padded_piece(image, text, degree, splits):
    """Each rank's [text share, image chunk] laid end to end: the whole text and image, padding only at the
    tail; where that cannot hold, every rank keeps the whole text."""
    x, t = torch.arange(1.0, image + 1).reshape(1, image, 1), -torch.arange(1.0, text + 1).reshape(1, text, 1)
    chunks = []
    for rank in range(degree):
        shard = SequenceShard(degree, rank, group=None)
        local_image, local_text = shard.shard(x, dim=1), shard.shard_text(t, dim=1)
        assert shard.text_len == (text if splits else 0)
        chunks.append(torch.cat([local_text, local_image], dim=1))
    if not splits:
        assert all(chunk.shape[1] == text + shard.local_len for chunk in chunks)
        return
    assert {chunk.shape[1] for chunk in chunks} == {text // degree + shard.local_len}
    sequence = torch.cat(chunks, dim=1)
    real = sequence[:, : image + text]
    assert sorted(real.flatten().tolist()) == sorted([*x.flatten().tolist(), *t.flatten().tolist()])
    assert not sequence[:, image + text:].any()


def test_info_command_describes_this_machine(capsys):
    from xstage_dit.cli import main

    main(["info"])
    printed = capsys.readouterr().out
    assert "backends: auto, fused, overlap, reference" in printed
    assert ("GPUs: none" in printed) != torch.cuda.is_available()


def test_the_package_works_without_triton():
    """Triton is optional (the fused backend's kernels): without it the package imports and `auto` runs."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, xstage_dit\n"
        "from xstage_dit.testing import zoo\n"
        "from xstage_dit.sp.attention.backends import available_backends\n"
        "assert 'fused' not in available_backends(), available_backends()\n"
        "pipe = zoo.build_pipeline('tiny-flux')\n"
        "pipe.set_progress_bar_config(disable=True)\n"
        "xstage_dit.enable(pipe)\n"
        "kwargs = zoo.call_kwargs('tiny-flux', height=32, width=48, num_frames=1, steps=1, guidance=1.0)\n"
        "pipe(**kwargs, **zoo.text_embeddings('tiny-flux', 1, seed=0), output_type='latent')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_models_attention_backend_runs_at_degree_one(flux_pipe, monkeypatch):
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    stock = _latents(flux_pipe, steps=1)
    math_backend = AttentionBackendName._NATIVE_MATH
    original = _AttentionBackendRegistry._backends[math_backend]
    calls = []
    monkeypatch.setitem(_AttentionBackendRegistry._backends, math_backend,
                        lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    flux_pipe.transformer.set_attention_backend("_native_math")
    xstage_dit.enable(flux_pipe)
    try:
        torch.testing.assert_close(_latents(flux_pipe, steps=1), stock, rtol=1e-5, atol=1e-6)
        assert calls
    finally:
        xstage_dit.disable(flux_pipe)
        flux_pipe.transformer.reset_attention_backend()


def test_a_guider_is_split_only_where_it_guides_every_step(caplog):
    """HunyuanVideo 1.5's pipeline guides through a guider: its two calls a step are split where it is diffusers'
    ClassifierFreeGuidance over the whole schedule; otherwise every CFG group computes every call, said once."""
    from types import SimpleNamespace

    from diffusers import AdaptiveProjectedGuidance, ClassifierFreeGuidance

    from xstage_dit.patches.cfg_rules import guider_guides_every_step

    def splits(guider) -> bool:
        return guider_guides_every_step({"self": SimpleNamespace(guider=guider)})

    assert splits(ClassifierFreeGuidance(guidance_scale=6.0))
    assert not splits(ClassifierFreeGuidance(guidance_scale=1.0))
    assert not splits(ClassifierFreeGuidance(guidance_scale=6.0, enabled=False))
    with caplog.at_level(logging.WARNING, logger="xstage_dit"):
        assert not splits(ClassifierFreeGuidance(guidance_scale=6.0, start=0.2))
        assert not splits(AdaptiveProjectedGuidance(guidance_scale=6.0))
    assert "start=0, stop=1" in caplog.text and "AdaptiveProjectedGuidance" in caplog.text


def _qwenimage21_with_flex(ranks: int) -> torch.Tensor:
    """Tiny Qwen-Image 2.1 latents with its flex-attention processor set after `enable` (at `ranks` ranks)."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21FlexAttnProcessor

    name = "tiny-qwenimage21"
    entry = zoo.ZOO[name]
    pipe = zoo.build_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    if ranks:
        xstage_dit.enable(pipe)
    pipe.transformer.set_attn_processor(QwenImage21FlexAttnProcessor())
    kwargs = zoo.call_kwargs(name, height=entry.height, width=entry.width, num_frames=1, steps=1, guidance=1.0)
    return pipe(**kwargs, **zoo.text_embeddings(name, 1, seed=0), output_type="latent",
                generator=torch.Generator().manual_seed(0)).images


def _refuses_flex_on_two_ranks() -> None:
    with pytest.raises(NotImplementedError, match="QwenImage21AttnProcessor.*BlockMask"):
        _qwenimage21_with_flex(2)


def test_a_flex_processor_set_after_enable_runs_unsplit_and_is_refused_split_in_words():
    """Qwen-Image 2.1's flex-attention processor, set after `enable`, passes a BlockMask over the whole sequence:
    at degree 1 diffusers attends with it (equal to stock); split over two ranks it is refused with what to do."""
    assert torch.equal(_qwenimage21_with_flex(1), _qwenimage21_with_flex(0))
    run_on_ranks(2, _refuses_flex_on_two_ranks)
