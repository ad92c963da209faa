"""enable(cuda_graphs=True) on a GPU: every replay equals the eager call on the same inputs bit for bit, through
whole pipeline calls whose timestep and latents change every step, with resolution and batch changing between
calls, CFG parallelism of both kinds and Wan 2.2's two transformers; forwards that cannot be captured run
eagerly with one warning. Two ranks use two GPUs with NCCL where there are two; on one GPU they share it over
gloo, whose collectives cannot be captured (then the check is that they fall back)."""
from __future__ import annotations

import copy
import importlib.util
import logging

import pytest
import torch

import xstage_dit
from xstage_dit.testing import zoo
from dist_harness import run_on_ranks
from xstage_dit.hooks.layers import stack_of
from xstage_dit.logging_utils import fresh_warnings
from xstage_dit.runtime.cuda_graphs import _BLOCK_GRAPHS, EAGER_CALLS, GraphedForward, repeated_blocks

pytestmark = pytest.mark.gpu
STEPS = 5  # a signature's third call is its first replay: the later steps (and the CFG branches) replay

SIZES = {  # two resolutions per config: a pipeline call at the second captures anew
    "tiny-flux-d64": [{"height": 32, "width": 48, "num_frames": 1}, {"height": 20, "width": 28, "num_frames": 1}],
    "tiny-wan-d64": [{"height": 32, "width": 48, "num_frames": 9}, {"height": 16, "width": 112, "num_frames": 17}],
    "tiny-wan2.2": [{"height": 32, "width": 48, "num_frames": 9}, {"height": 16, "width": 112, "num_frames": 17}],
    "tiny-sd3.5": [{"height": 48, "width": 64, "num_frames": 1}, {"height": 40, "width": 56, "num_frames": 1}],
    "tiny-nucleusmoe-d64": [{"height": 48, "width": 64, "num_frames": 1},
                            {"height": 40, "width": 56, "num_frames": 1}],
    "tiny-chroma": [{"height": 32, "width": 48, "num_frames": 1}, {"height": 20, "width": 28, "num_frames": 1}],
    "tiny-qwenimage": [{"height": 64, "width": 96, "num_frames": 1}, {"height": 48, "width": 64, "num_frames": 1}],
}


def _generate(pipe, name: str, size: dict, batch: int, steps: int = STEPS) -> torch.Tensor:
    kwargs = zoo.call_kwargs(name, **size, steps=steps, guidance=3.0)
    embeddings = zoo.text_embeddings(name, batch, seed=batch, device=pipe.device, dtype=torch.bfloat16)
    return pipe(**kwargs, **embeddings, output_type="latent", generator=torch.Generator().manual_seed(3),
                return_dict=False)[0]


def _graphed(pipe) -> list[GraphedForward]:
    models = [m for m in (pipe.transformer, getattr(pipe, "transformer_2", None)) if m is not None]
    return [graphed for m in models for graphed in stack_of(m).changes_of("CUDA graphs")]


def _graphs_equal_eager(name: str, expect_captures: bool, **enable: object) -> None:
    """Every case (batch 1 and 2, two resolutions, one after the other) with graphs equals it eagerly."""
    pipe = zoo.build_pipeline(name, device=xstage_dit.local_device(), dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    cases = [(batch, size) for size in range(2) for batch in (1, 2)]
    xstage_dit.enable(pipe, cuda_graphs=False, timeout_s=60, **enable)
    eager = [_generate(pipe, name, SIZES[name][size], batch) for batch, size in cases]
    xstage_dit.disable(pipe)
    xstage_dit.enable(pipe, cuda_graphs=True, timeout_s=60, **enable)
    graphed = _graphed(pipe)
    for (batch, size), expected in zip(cases, eager):
        out = _generate(pipe, name, SIZES[name][size], batch)
        assert torch.equal(out, expected), f"{name} {enable}, batch {batch}, size {size}: graphs differ from eager"
    captured = sum(g.captured for g in graphed)
    assert (captured > 0) == expect_captures, f"{name} {enable}: {captured} graphs held, {len(graphed)} graphed"
    assert (xstage_dit.cuda_graph_use(pipe).replays > 0) == expect_captures
    xstage_dit.disable(pipe)
    assert all("forward" not in m.__dict__ for m in (pipe.transformer, getattr(pipe, "transformer_2", None)) if m)


# Chroma and QwenImage: their forwards hold no host copy once enabled (patches/image/chroma.py,
# patches/image/qwenimage.py)
@pytest.mark.parametrize("name", [pytest.param("tiny-flux-d64", marks=pytest.mark.smoke), "tiny-wan2.2", "tiny-sd3.5",
                                  "tiny-chroma", "tiny-qwenimage"])
@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_one_gpu_replays_equal_eager(name, backend):
    _graphs_equal_eager(name, True, backend=backend)


def _two_rank_worker(name: str, backend: str, cfg_degree: int, expert_parallel: bool | None = None) -> None:
    # else both ranks on one GPU (the job's placement): gloo, which graphs cannot hold
    two_gpus = torch.cuda.device_count() >= 2
    # with cfg_degree=2 each rank is a Ulysses group of one: its forward holds no collective (the CFG exchange
    # runs outside the graph), so it is captured over gloo too
    _graphs_equal_eager(name, two_gpus or cfg_degree == 2, backend=backend, cfg_degree=cfg_degree,
                        expert_parallel=expert_parallel)


@pytest.mark.parametrize("name, backend, cfg_degree, expert_parallel", [
    ("tiny-flux-d64", "reference", 1, None), ("tiny-flux-d64", "fused", 1, None), ("tiny-wan-d64", "fused", 1, None),
    ("tiny-wan2.2", "reference", 1, None),
    ("tiny-flux-d64", "fused", 2, None),  # CFG in pairs of calls: a graph holds this rank's branch
    ("tiny-sd3.5", "reference", 2, None),  # CFG as a batch
    # keys-only text; expert choice's score gather (stores over the fabric) and replicated experts in the graph
    ("tiny-nucleusmoe-d64", "fused", 1, False),
    # the experts sharded over the fused backend's fabric: the X-Stage dispatch and combine replay
    ("tiny-nucleusmoe-d64", "fused", 1, True),
])
def test_two_ranks_replays_equal_eager(name, backend, cfg_degree, expert_parallel):
    run_on_ranks(2, _two_rank_worker, name, backend, cfg_degree, expert_parallel, deadline_s=150)


def _ring_worker(name: str, backend: str) -> None:
    # else both ranks on one GPU (the job's placement): gloo, whose sends and output gather graphs cannot hold
    two_gpus = torch.cuda.device_count() >= 2
    _graphs_equal_eager(name, two_gpus, backend=backend, ring_degree=2)


@pytest.mark.parametrize("name", ["tiny-flux-d64", "tiny-wan-d64"])
@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_a_ring_replays_equal_eager(name, backend):
    """A ring of 2 (the reference ring's blocks by NCCL point-to-point inside the graph, the fused ring's by the
    attention kernel's stores and the barrier's device-side epochs): replays on fresh inputs equal eager bit for
    bit. NCCL takes one rank per GPU, so the capture is checked on two GPUs only; on one GPU the two ranks share it
    over gloo (the forward's output gather too) and the check is that they run eagerly, equal to themselves."""
    run_on_ranks(2, _ring_worker, name, backend, deadline_s=150)


def _first_block_cache(pipe) -> None:
    from diffusers.hooks import FirstBlockCacheConfig

    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.05))


def _cache_dit(pipe) -> None:
    import cache_dit
    from cache_dit import DBCacheConfig

    cache_dit.enable_cache(pipe, cache_config=DBCacheConfig(Fn_compute_blocks=1, Bn_compute_blocks=0,
                                                            residual_diff_threshold=0.05))


@pytest.mark.parametrize("enable_cache, named", [
    (_first_block_cache, "fbc_leader_block_hook"),
    pytest.param(_cache_dit, "cache-dit's cache", marks=pytest.mark.skipif(
        importlib.util.find_spec("cache_dit") is None, reason="cache-dit is not installed (the test extra has it)"))])
def test_a_cached_forward_runs_eagerly_with_one_warning(enable_cache, named, caplog):
    """diffusers' FirstBlockCache and cache-dit's DBCache decide on the host each step: graphs cannot hold them."""
    name = "tiny-flux-d64"
    pipe = zoo.build_pipeline(name, device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    enable_cache(pipe)
    xstage_dit.enable(pipe, cuda_graphs=False)
    eager = _generate(pipe, name, SIZES[name][0], 1)
    xstage_dit.disable(pipe)
    xstage_dit.enable(pipe, cuda_graphs=True)
    with caplog.at_level(logging.WARNING, logger="xstage_dit"):
        out = _generate(pipe, name, SIZES[name][0], 1)
    assert torch.equal(out, eager)
    assert _graphed(pipe)[0].captured == 0
    assert any(named in r.getMessage() and "decide on the host" in r.getMessage()
               for r in caplog.records), caplog.text
    xstage_dit.disable(pipe)


# Flux's whole forward is captured; Edit-2511's syncs the host, so its blocks are
@pytest.mark.parametrize("name, whole", [("tiny-flux-d64", True), ("tiny-qwenimage-edit-2511", False)])
def test_compiled_blocks_replay_in_graphs(name, whole):
    """compile_repeated_blocks + graphs: the compiled blocks' kernels replay (in the forward's graph, or in their
    own); equal to the compiled eager run."""
    size = SIZES.get(name, [{"height": 64, "width": 96, "num_frames": 1}])[0]
    pipe = zoo.build_pipeline(name, device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.compile_repeated_blocks(fullgraph=True)
    xstage_dit.enable(pipe, cuda_graphs=False)
    eager = _generate(pipe, name, size, 1)
    xstage_dit.disable(pipe)
    xstage_dit.enable(pipe, cuda_graphs=True)
    out = _generate(pipe, name, size, 1)
    if whole:
        assert _graphed(pipe)[0].captured >= 1
    else:
        assert xstage_dit.cuda_graph_use(pipe).block_replays > 0
    assert torch.equal(out, eager)
    xstage_dit.disable(pipe)


class _Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
        return torch.relu(x) * factor


class _SyncingScale(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x.abs().max().item()


@pytest.mark.smoke
def test_a_forward_replays_per_signature_and_holds_a_bounded_number():
    """Fresh inputs every call: replays equal eager bit for bit; a non-tensor argument is part of the signature;
    more signatures than the bound drop the least recently used graph."""
    from xstage_dit.runtime.cuda_graphs import CAPTURED_SIGNATURES

    model = _Scale()
    graphed = GraphedForward(model, torch.device("cuda"))
    with torch.no_grad():
        for length in range(1, CAPTURED_SIGNATURES + 2):
            for call in range(EAGER_CALLS + 3):
                x = torch.randn(3, length, device="cuda")
                factor = 2.0 if call % 2 else 3.0  # two signatures per length, alternating
                assert torch.equal(model(x, factor), torch.relu(x) * factor)
    assert graphed.captured == CAPTURED_SIGNATURES
    graphed.remove()
    assert "forward" not in model.__dict__


def test_graph_use_tells_replays_from_warm_up_and_capture():
    from xstage_dit.runtime.cuda_graphs import GraphUse

    model = _Scale()
    graphed = GraphedForward(model, torch.device("cuda"))
    with torch.no_grad():
        for _ in range(EAGER_CALLS + 3):  # warm-up calls, the capture, two replays
            model(torch.randn(3, 4, device="cuda"), 2.0)
    assert graphed.use == GraphUse(replays=2, other_calls=EAGER_CALLS + 1)
    graphed.remove()


def test_a_forward_that_syncs_the_host_runs_eagerly_with_one_warning(caplog):
    model = _SyncingScale()
    graphed = GraphedForward(model, torch.device("cuda"))
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="xstage_dit"):
        for _ in range(5):
            x = torch.randn(4, device="cuda")
            assert torch.equal(model(x), x * x.abs().max().item())
    assert graphed.captured == 0
    assert any("synchronises the host" in r.getMessage() for r in caplog.records), caplog.text


# the tiny configs whose forward runs eagerly with graphs on: the warning's words (the diffusers code that
# synchronises the host: a modulation index built from host lists; a host check of the conditioning and a
# boolean-mask index; Qwen-Image 2.1's and FLUX.2's KV cache objects), and whether their blocks replay instead
EAGER_FORWARDS = {
    "tiny-qwenimage-edit-2511": ("synchronises the host", True),
    "tiny-hunyuan-video15": ("synchronises the host", True),
    "tiny-qwenimage21": ("gets an argument of type QwenImage21KVCache", False),
    "tiny-flux2-klein-kv": ("gets an argument of type Flux2KVCache", False),
}
# the tiny configs whose ControlNet runs eagerly beside a replaying transformer: the warning's words (diffusers'
# Z-Image ControlNet indexes its padding with a boolean mask, which synchronises the host)
EAGER_CONTROLNETS = {
    "tiny-zimage-controlnet": "ZImageControlNetModel's forward synchronises the host",
    "tiny-zimage-controlnet-inpaint": "ZImageControlNetModel's forward synchronises the host",
}


@pytest.mark.parametrize("name", sorted(n for n in zoo.ZOO if n.startswith("tiny-")))
def test_every_config_replays_or_says_why(name, caplog):
    """Every tiny config's forward either replays (equal to eager bit for bit) or, for the few listed above, runs
    eagerly after a warning, its blocks replaying where they can; a family whose forward starts or stops
    replaying fails here."""
    entry = zoo.ZOO[name]
    size = {"height": entry.height, "width": entry.width, "num_frames": entry.num_frames}
    pipe = zoo.build_pipeline(name, device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    with fresh_warnings():  # earlier tests may have said them
        xstage_dit.enable(pipe, cuda_graphs=False)
        steps = 2 * STEPS  # image-to-image pipelines run only their `strength` share of the steps
        eager = _generate(pipe, name, size, 1, steps)
        xstage_dit.disable(pipe)
        xstage_dit.enable(pipe, cuda_graphs=True)
        with caplog.at_level(logging.WARNING, logger="xstage_dit"):
            out = _generate(pipe, name, size, 1, steps)
        use = xstage_dit.cuda_graph_use(pipe)
        xstage_dit.disable(pipe)
    assert torch.equal(out, eager), f"{name}: graphs differ from eager"
    warnings = [r.getMessage() for r in caplog.records if "xstage_dit:" in r.getMessage()]
    if name in EAGER_FORWARDS:
        words, blocks_replay = EAGER_FORWARDS[name]
        assert use.replays == 0 and any(words in w for w in warnings), f"{name}: {use}, warnings {warnings}"
        assert (use.block_replays > 0) == blocks_replay, f"{name}: {use}"
    else:
        assert use.replays > 0 and use.block_replays == 0, f"{name}: {use}, warnings {warnings}"
        expected = EAGER_CONTROLNETS.get(name)
        assert not any("eagerly" in w and not (expected and expected in w) for w in warnings), f"{name}: {warnings}"
        assert expected is None or any(expected in w for w in warnings), f"{name}: {warnings}"


_HOST_STATE = {"scale": 1.0}  # what the blocks below read besides their arguments


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, holder: object = None) -> torch.Tensor:
        return torch.relu(self.linear(x)) * _HOST_STATE["scale"]


class _SyncingModel(torch.nn.Module):
    _repeated_blocks = ["_Block"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x: torch.Tensor, holder: object = None) -> torch.Tensor:
        x = x / x.abs().max().item()
        for block in self.blocks:
            x = block(x, holder)
        return x


def test_blocks_replay_where_the_forward_syncs_the_host(caplog):
    """Fresh inputs every call: equal to the model run eagerly bit for bit, also after the host state the blocks
    read changes; the blocks share their graphs' static buffers; a block call with an object argument runs
    eagerly; remove() restores the blocks."""
    model = _SyncingModel().cuda()
    reference = copy.deepcopy(model)
    original = type(model.blocks[0])
    graphed = GraphedForward(model, torch.device("cuda"), blocks=repeated_blocks(model),
                             block_state=lambda: _HOST_STATE["scale"])
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="xstage_dit"):
        for scale in (1.0, 2.0):
            _HOST_STATE["scale"] = scale
            for _ in range(EAGER_CALLS + 4):
                x = torch.randn(5, 16, device="cuda")
                assert torch.equal(model(x), reference(x))
        # per block: two eager calls (the model's own watched call found the sync), then per scale two eager
        # calls, the capture, and one replay at scale 1 and three at scale 2
        replays = graphed.use.block_replays
        assert graphed.captured == 0 and replays == 3 * (1 + 3), graphed.use
        x = torch.randn(5, 16, device="cuda")
        assert torch.equal(model(x, holder=object()), reference(x))
        assert graphed.use.block_replays == replays
    _HOST_STATE["scale"] = 1.0
    # the three blocks' graphs of one signature read one set of static inputs: one tensor per scale
    held = [block.__dict__[_BLOCK_GRAPHS]._graphs.values() for block in model.blocks]
    assert len({id(tensor) for graphs in held for graph in graphs for tensor in graph.inputs}) == 2
    messages = caplog.text
    assert "synchronises the host" in messages and "blocks (_Block, ...) replay" in messages, messages
    assert "gets an argument of type object" in messages, messages
    graphed.remove()
    assert type(model.blocks[0]) is original and "forward" not in model.__dict__
    assert all(set(block.__dict__) == set(fresh.__dict__) for block, fresh in zip(model.blocks, reference.blocks))
