"""A patched transformer compiles as stock diffusers does: diffusers' compile_repeated_blocks(fullgraph=True) and
torch.compile(transformer, fullgraph=True) compile no more graphs than for stock diffusers (no recompile per block
instance), with no graph break in the attention path (Ulysses attention is one custom op,
xstage::ulysses_attention; at degree 1 xstage::local_attention). fullgraph=True turns any graph break into an
error; the eager compile backend keeps the tests fast on CPU. Compiled output equals eager output, and `disable`
after a compile restores the model. With a cache (diffusers' or cache-dit's: tests/test_caches.py,
tests/test_cache_dit.py): check_cache_under_compile."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import pytest
import torch
import diffusers

import xstage_dit
from xstage_dit.testing import zoo
from compile_checks import compile_and_compare, ranks_worker
from dist_harness import run_on_ranks, share_one_gpu
from torch._dynamo.utils import counters


# compile_repeated_blocks in one process: test_every_family_with_repeated_blocks_compiles_as_often_as_stock
@pytest.mark.parametrize("family", ["flux", "wan"])
def test_a_model_compiled_whole_compiles_as_often_as_stock_in_one_process(family):
    compile_and_compare(family, "whole", extra_graphs=0)


@pytest.mark.parametrize("family, mode, world_size",
                         [(family, mode, 2) for family in ("flux", "wan") for mode in ("blocks", "whole")]
                         # each family once more at degree 3 or 4 (uneven token counts there too); the whole-model
                         # mode at those degrees compiles the same blocks and takes minutes of CI
                         + [("flux", "blocks", 3), ("wan", "blocks", 4), ("flux2", "blocks", 2)])
def test_compiled_blocks_and_models_compile_as_often_as_stock_on_several_ranks(family, mode, world_size):
    # the forward pre-hook that splits the tokens compiles as a graph of its own where it sits on a compiled
    # module: Flux's on the model (torch.compile of the model), Wan's on the first block (compile_repeated_blocks)
    extra = 1 if (family, mode) in (("flux", "whole"), ("wan", "blocks")) else 0
    run_on_ranks(world_size, ranks_worker, family, mode, extra, deadline_s=300)


def _one_gpu_ranks_worker(family: str, backend: str) -> None:
    share_one_gpu()
    # Wan's token-splitting pre-hook sits on its first block, which compile_repeated_blocks compiles
    compile_and_compare(family, "blocks", 1 if family.startswith("wan") else 0, backend, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("family, backend", [("flux-d64", name) for name in ("reference", "overlap", "fused", "auto")]
                         + [("wan-d64", "fused")])
def test_real_depth_compiles_as_often_as_stock_on_two_ranks_of_one_gpu(family, backend):
    """Every backend on a GPU under compile_repeated_blocks (the fused one with Flux's and Wan's q/k norms and
    rotation in its stores), two ranks sharing the GPU."""
    run_on_ranks(2, _one_gpu_ranks_worker, family, backend, deadline_s=300)


def _pipeline(name: str, steps: int, dtype: torch.dtype = torch.float32):
    """A zoo pipeline at its default size, and a call of it returning its latents (seeded)."""
    pipe = zoo.build_pipeline(name, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    entry = zoo.ZOO[name]
    kwargs = zoo.call_kwargs(name, height=entry.height, width=entry.width, num_frames=entry.num_frames,
                             steps=steps, guidance=3.0)

    def generate() -> torch.Tensor:
        return pipe(**kwargs, **zoo.text_embeddings(name, 1, seed=0, dtype=dtype), output_type="latent",
                    generator=torch.Generator().manual_seed(0), return_dict=False)[0]

    return pipe, generate


def _pipeline_worker(name: str, backend: str) -> None:
    pipe, generate = _pipeline(name, steps=2)
    stock = generate()
    xstage_dit.enable(pipe, backend=backend, timeout_s=120)
    pipe.transformer.compile_repeated_blocks(fullgraph=True, backend="eager")
    out = generate()
    error = ((out - stock).norm() / stock.norm()).item()
    assert error < 1e-4, f"compiled {name}: relative error {error:.2e}"


@pytest.mark.parametrize("name, backend", [("tiny-flux", "reference"), ("tiny-wan", "overlap")])
def test_compiled_pipeline_equals_stock(name, backend):
    run_on_ranks(2, _pipeline_worker, name, backend)


@contextlib.contextmanager
def _at_depth(name: str, depth: int) -> Iterator[str]:
    """The zoo entry `name` with `depth` blocks of each kind, registered under a name of its own meanwhile."""
    entry = zoo.ZOO[name]
    layers = {key: depth for key in ("num_layers", "num_single_layers", "n_layers") if key in entry.transformer}
    deep = f"{name}-depth-{depth}"
    zoo.ZOO[deep] = dataclasses.replace(entry, transformer={**entry.transformer, **layers})
    try:
        yield deep
    finally:
        del zoo.ZOO[deep]


@dataclasses.dataclass
class CompiledRun:
    eager: torch.Tensor  # the latents of an eager pipeline call
    compiled: torch.Tensor  # the same call's with the transformers compiled
    graphs: int  # graphs Dynamo compiled for it
    after_disable: torch.Tensor | None = None  # a call after `disable`, the compiled code still in place


def _compiled_pipeline(name: str, mode: str, enabled: bool, dtype: torch.dtype = torch.float32,
                       call_after_disable: bool = False, expert_parallel: bool = False) -> CompiledRun:
    """One pipeline call eager, then one with its transformers compiled (fullgraph, Dynamo's eager backend):
    their blocks by compile_repeated_blocks (`mode` "blocks") or each transformer whole ("whole"); where asked,
    one more after `disable`."""
    pipe, generate = _pipeline(name, steps=2, dtype=dtype)
    transformers = [model for model in (pipe.transformer, getattr(pipe, "transformer_2", None)) if model is not None]
    if enabled:
        xstage_dit.enable(pipe, backend="reference", timeout_s=120, expert_parallel=expert_parallel)
    eager = generate()
    torch._dynamo.reset()
    counters.clear()
    for model in transformers:
        if mode == "blocks":
            model.compile_repeated_blocks(fullgraph=True, backend="eager")
        else:
            model.compile(fullgraph=True, backend="eager")
    try:
        compiled = generate()
    finally:
        if enabled:
            xstage_dit.disable(pipe)  # the routing of diffusers' names is process-wide
    run = CompiledRun(eager, compiled, counters["stats"]["unique_graphs"])
    if call_after_disable:
        # Dynamo keeps what it compiled while enabled, and the stock code's graphs come on top (LTX-2's blocks:
        # 5 + 5, past torch's default recompile_limit of 8)
        with torch._dynamo.config.patch(recompile_limit=2 * torch._dynamo.config.recompile_limit):
            run.after_disable = generate()
    for model in transformers:
        for module in model.modules():
            module._compiled_call_impl = None
    return run


# the families whose diffusers model names its repeated blocks (SD3, CogVideoX and HiDream do not)
WITH_REPEATED_BLOCKS = ["tiny-flux", "tiny-wan", "tiny-hunyuan-video", "tiny-qwenimage", "tiny-ltx", "tiny-flux2",
                        "tiny-wan-vace", "tiny-zimage", "tiny-chroma", "tiny-hunyuan-video15", "tiny-ltx2",
                        "tiny-qwenimage21", "tiny-qwenimage-edit-2511", "tiny-wan2.2"]
# the families whose stock forward compiles whole with fullgraph (HunyuanVideo 1.5 and Qwen-Image 2.1 read values
# back to the host before their blocks; stock HiDream's experts read counts back from the device)
COMPILING_WHOLE = [name for name in WITH_REPEATED_BLOCKS if name not in ("tiny-hunyuan-video15", "tiny-qwenimage21")
                   ] + ["tiny-sd3.5", "tiny-cogvideox"]


@pytest.mark.parametrize("name", WITH_REPEATED_BLOCKS)
def test_every_family_with_repeated_blocks_compiles_as_often_as_stock(name):
    """Four blocks deep, one process: as many graphs as stock diffusers, compiled equal to eager; after `disable`
    the compiled blocks run stock diffusers' code again."""
    with _at_depth(name, 4) as deep:
        stock = _compiled_pipeline(deep, "blocks", False)
        ours = _compiled_pipeline(deep, "blocks", True, call_after_disable=True)
    assert ours.graphs == stock.graphs
    torch.testing.assert_close(ours.compiled, ours.eager, rtol=0, atol=0)
    torch.testing.assert_close(ours.after_disable, stock.eager, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["tiny-sd3.5", "tiny-cogvideox"])
def test_families_without_repeated_blocks_compile_whole_as_often_as_stock(name):
    """SD3 and CogVideoX name no repeated blocks: torch.compile of the whole transformer, one process."""
    stock = _compiled_pipeline(name, "whole", False)
    ours = _compiled_pipeline(name, "whole", True)
    assert ours.graphs == stock.graphs
    torch.testing.assert_close(ours.compiled, ours.eager, rtol=0, atol=0)


def _depth_independent_worker(name: str, mode: str) -> None:
    # a model compiled whole is one frame that inlines every block: its graphs cannot depend on the depth
    depths = (2, 3) if mode == "blocks" else (2,)
    graphs = {}
    for depth in depths:
        with _at_depth(name, depth) as deep:
            run = _compiled_pipeline(deep, mode, True)
        graphs[depth] = run.graphs
        error = ((run.compiled - run.eager).norm() / run.eager.norm()).item()
        assert error < 1e-5, f"compiled {name} ({mode}) at depth {depth} differs from eager: {error:.2e}"
    if mode == "blocks":
        assert graphs[3] == graphs[2], (f"{name} ({mode}): {graphs[3]} graphs at depth 3, {graphs[2]} at depth "
                                        "2: a block instance compiled anew")


# (mode, degree) -> the families compiled in that mode on that many ranks: each family in each mode at one degree
# (every family at every degree would take minutes of CI), its two modes at two degrees, 3 or 4 among them (token
# counts that the degree does not divide). A family's costlier mode (blocks: two depths) runs at 2, where the ranks
# do not outnumber the CI machine's two cores.
ON_SEVERAL_RANKS = {
    ("blocks", 2): ["tiny-hunyuan-video", "tiny-wan-vace", "tiny-hunyuan-video15", "tiny-ltx2",
                    "tiny-qwenimage-edit-2511"],
    ("blocks", 3): ["tiny-flux", "tiny-ltx", "tiny-zimage", "tiny-chroma"],
    ("blocks", 4): ["tiny-wan", "tiny-qwenimage", "tiny-flux2", "tiny-qwenimage21", "tiny-wan2.2"],
    ("whole", 2): ["tiny-flux", "tiny-wan", "tiny-qwenimage", "tiny-ltx", "tiny-flux2", "tiny-zimage", "tiny-chroma",
                   "tiny-wan2.2", "tiny-cogvideox"],
    ("whole", 3): ["tiny-hunyuan-video", "tiny-ltx2", "tiny-qwenimage-edit-2511"],
    ("whole", 4): ["tiny-wan-vace", "tiny-sd3.5"],
}


def test_every_family_compiles_on_several_ranks_in_each_mode():
    """ON_SEVERAL_RANKS places every family once in each mode it compiles in, each at 3 or 4 ranks in one mode."""
    for mode, families in (("blocks", WITH_REPEATED_BLOCKS), ("whole", COMPILING_WHOLE)):
        placed = [name for (on, _), names in ON_SEVERAL_RANKS.items() if on == mode for name in names]
        assert sorted(placed) == sorted(families), mode
        assert {degree for on, degree in ON_SEVERAL_RANKS if on == mode} == {2, 3, 4}, mode
    for name in set(WITH_REPEATED_BLOCKS) & set(COMPILING_WHOLE):
        degrees = {degree for (_, degree), names in ON_SEVERAL_RANKS.items() if name in names}
        assert degrees & {3, 4}, f"{name} compiles on no degree that leaves uneven token counts"


@pytest.mark.parametrize("name, mode, world_size",
                         [(name, mode, world_size) for (mode, world_size), names in ON_SEVERAL_RANKS.items()
                          for name in names])
def test_every_family_compiles_each_block_class_once_on_several_ranks(name, mode, world_size):
    """Every family on several ranks (reference backend), in each mode (ON_SEVERAL_RANKS): no graph break
    (fullgraph), compiled equal to eager; with compile_repeated_blocks one block instance more compiles nothing
    more (as many graphs at three blocks of each kind as at two; the graphs of the split's hooks come once)."""
    run_on_ranks(world_size, _depth_independent_worker, name, mode, deadline_s=600)


def test_hidream_compiles_whole_without_a_graph_break():
    """Stock HiDream cannot compile fullgraph (its experts loop over counts read back from the device); with
    xstage_dit its grouped experts (sp/moe/grouped.py) trace. bf16: torch._grouped_mm's fake kernel takes bf16 only."""
    run = _compiled_pipeline("tiny-hidream", "whole", True, torch.bfloat16)
    torch.testing.assert_close(run.compiled, run.eager, rtol=0, atol=0)


def _nucleus_blocks_worker(expert_parallel: bool) -> None:
    run = _compiled_pipeline("tiny-nucleusmoe", "blocks", True, torch.bfloat16, expert_parallel=expert_parallel)
    # one graph per kind of block: dense, and MoE at each capacity factor (a float the block's code reads)
    assert run.graphs == 3, run.graphs
    torch.testing.assert_close(run.compiled, run.eager, rtol=0, atol=0)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_nucleusmoe_blocks_compile_on_two_ranks_without_a_graph_break(expert_parallel):
    """Stock NucleusMoE cannot compile fullgraph (its experts loop over counts read back from the device); with
    xstage_dit its exact expert choice (the router scores' all-gather, top-k, grouped experts; expert parallel:
    the tokens' all-gather and the outputs' reduce-scatter too) traces. bf16: torch._grouped_mm's fake kernel
    takes bf16 only."""
    run_on_ranks(2, _nucleus_blocks_worker, expert_parallel, deadline_s=300)


def test_nucleusmoe_compiles_whole_once_when_enabled():
    """Enabled at degree 1, NucleusMoE compiled whole (dense blocks, fullgraph) runs its second call on the first
    call's graph: the rotary tables that xstage_dit keeps per image shape are diffusers' computation when traced,
    so no guard on the kept ones recompiles."""
    torch.manual_seed(0)
    model = diffusers.NucleusMoEImageTransformer2DModel(
        **{**zoo.ZOO["tiny-nucleusmoe"].transformer, "moe_enabled": False}).eval()
    generator = torch.Generator().manual_seed(2)
    inputs = dict(hidden_states=torch.randn(1, 16, 16, generator=generator),
                  encoder_hidden_states=torch.randn(1, 6, 32, generator=generator),
                  encoder_hidden_states_mask=torch.ones(1, 6, dtype=torch.long), timestep=torch.tensor([0.5]),
                  img_shapes=[(1, 4, 4)], return_dict=False)
    with torch.no_grad():
        stock = model(**inputs)[0]
    xstage_dit.enable(model, timeout_s=60)
    try:
        with torch.no_grad():
            torch._dynamo.reset()
            compiled = torch.compile(model, fullgraph=True, backend="eager")  # its first call is traced
            with torch._dynamo.config.patch(error_on_recompile=True):
                outs = [compiled(**inputs)[0] for _ in range(2)]
    finally:
        xstage_dit.disable(model)
        torch._dynamo.reset()
    for out in outs:
        torch.testing.assert_close(out, stock, rtol=1e-5, atol=1e-5)


def _ltx2_blocks_worker() -> None:
    from diffusers import LTX2VideoTransformer3DModel
    from pipeline_checks import LTX2_CONFIG

    torch.manual_seed(0)
    model = LTX2VideoTransformer3DModel(**{**LTX2_CONFIG, "num_layers": 4}).eval()
    generator = torch.Generator().manual_seed(5)
    inputs = dict(hidden_states=torch.randn(1, 35, 8, generator=generator),
                  audio_hidden_states=torch.randn(1, 11, 8, generator=generator),
                  encoder_hidden_states=torch.randn(1, 6, 32, generator=generator),
                  audio_encoder_hidden_states=torch.randn(1, 6, 32, generator=generator),
                  timestep=torch.tensor([500.0]), sigma=torch.tensor([0.5]), num_frames=5, height=1, width=7,
                  audio_num_frames=11)
    xstage_dit.enable(model, backend="reference", timeout_s=120)
    with torch.no_grad():
        eager = model(**inputs).audio_sample
        torch._dynamo.reset()
        counters.clear()
        model.compile_repeated_blocks(fullgraph=True, backend="eager")
        compiled = model(**inputs).audio_sample
    assert counters["stats"]["unique_graphs"] == 1, counters["stats"]["unique_graphs"]
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_ltx2_blocks_compile_on_two_ranks_without_a_graph_break():
    """LTX-2's blocks hold both kinds of routed attention (Ulysses video self-attention, video-to-audio over the
    gathered video keys): four blocks compile as one graph, fullgraph, at 2 ranks."""
    run_on_ranks(2, _ltx2_blocks_worker, deadline_s=300)


class _Doubled(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def test_compiled_code_follows_swapped_classes(monkeypatch):
    """A module switched to another class (module_forward.SwappedClasses: the GELU epilogue, split projections)
    and back is run by the code compiled for its current class, also where dynamo skips re-checking modules whose
    instance dict did not change (recursive dict tags, on by default in some torch releases)."""
    from xstage_dit.hooks.module_forward import SwappedClasses

    monkeypatch.setattr(torch._dynamo.config, "use_recursive_dict_tags_for_guards", True)
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    compiled = torch.compile(block, backend="eager", fullgraph=True)
    x = torch.randn(3, 4)
    plain = compiled(x)
    swap = SwappedClasses([block[0]], _Doubled)
    assert torch.equal(compiled(x), block(x))  # eager, through the swapped class
    assert not torch.equal(compiled(x), plain)
    swap.remove()
    assert torch.equal(compiled(x), plain)
