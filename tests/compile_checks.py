"""What the compile tests share: a ledger of the graphs torch.compile makes (and whose code they trace), a model
or pipeline compiled as stock and as enabled, compared for results and for how often each compiles, and a cache
checked under compile in each order with `enable`."""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable

import diffusers
import torch

import xstage_dit
from xstage_dit.testing import zoo
from torch._dynamo.utils import counters


XSTAGE_DIT = os.path.dirname(xstage_dit.__file__) + os.sep


@dataclasses.dataclass(frozen=True)
class Graph:
    """One graph Dynamo compiled: the file of its frame, and whether that frame had compiled before (a guard
    failed: a recompile)."""

    frame: str | None  # None: a graph without operations
    recompiled: bool

    @property
    def ours(self) -> bool:
        """A frame of xstage_dit's (a hook of the split, compiled apart where a cache's graph break leaves it a
        frame of its own), or one without operations left between such hooks."""
        return self.frame is None or self.frame.startswith(XSTAGE_DIT)


class GraphLedger:
    """A Dynamo backend (running graphs as traced, like backend="eager") that lists the graphs it is given."""

    def __init__(self) -> None:
        self.graphs: list[Graph] = []

    def __call__(self, graph_module: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        frames = [_outermost_file(node.meta.get("stack_trace", "")) for node in graph_module.graph.nodes]
        compile_id = torch._guards.CompileContext.current_compile_id()
        self.graphs.append(Graph(next((frame for frame in frames if frame), None),
                                 bool(compile_id and compile_id.frame_compile_id)))
        return graph_module.forward


def _outermost_file(stack_trace: str) -> str | None:
    """The file of the frame Dynamo compiled, where an operation's stack trace begins."""
    found = re.search(r'File "([^"]+)", line', stack_trace or "")
    return found.group(1) if found else None


@dataclasses.dataclass
class CompiledTwice:
    """Two equal pipeline calls with the transformer compiled: the first's latents, and the graphs each compiled."""

    out: torch.Tensor
    first: list[Graph]
    second: list[Graph]


def compile_transformer(pipe: Any, mode: str, backend: Callable[..., Any]) -> None:
    """Compile `pipe.transformer`: its repeated blocks ("blocks"; "fullgraph blocks", where a cache leaves the
    blocks without a host decision), the model in place ("whole"), or the pipeline given
    `torch.compile(transformer)` ("wrapped"); not fullgraph otherwise, as a cache's host decisions break graphs."""
    if mode.endswith("blocks"):
        pipe.transformer.compile_repeated_blocks(fullgraph=mode == "fullgraph blocks", backend=backend)
    elif mode == "whole":
        pipe.transformer.compile(backend=backend)
    else:
        pipe.transformer = torch.compile(pipe.transformer, backend=backend)


def called_twice(ledger: GraphLedger, generate: Callable[[], torch.Tensor]) -> CompiledTwice:
    out = generate()
    first = list(ledger.graphs)
    generate()
    return CompiledTwice(out, first, ledger.graphs[len(first):])


# the orders of a cache, xstage_dit and the compile that the cache tests take (each test one): the cache before
# `enable`, and after it and the compile
CACHE_FIRST = ("cache", "enable", "compile")


CACHE_LAST = ("enable", "compile", "cache")


def order_id(value: Any) -> str | None:
    """A test id for an order of steps ("cache-enable-compile"); pytest's own for other parameters."""
    return "-".join(value) if isinstance(value, tuple) else None


def check_cache_under_compile(build: Callable[[], Any], mode: str, order: tuple[str, ...],
                              enable_cache: Callable[[Any], Any], generate: Callable[[Any], torch.Tensor],
                              what: str) -> None:
    """A cache with the transformer compiled (`compile_transformer`'s `mode`), enabled with xstage_dit in `order`
    on this job's ranks: one process's result with the same cache and compile (which the cache changes), and no
    more graphs or recompiles than there (assert_compiles_as_often_as_stock). `build` makes a pipeline,
    `enable_cache` enables the cache on one, `generate` calls one."""
    def compiled(order: tuple[str, ...]) -> CompiledTwice:
        pipe = build()
        torch._dynamo.reset()
        ledger = GraphLedger()
        steps = {"cache": lambda: enable_cache(pipe),
                 "enable": lambda: xstage_dit.enable(pipe, backend="reference", timeout_s=60),
                 "compile": lambda: compile_transformer(pipe, mode, ledger)}
        for step in order:
            steps[step]()
        return called_twice(ledger, lambda: generate(pipe))

    uncached = generate(build())
    stock = compiled(("cache", "compile"))
    assert not torch.equal(stock.out, uncached), f"{what}: the cache changed nothing"
    ours = compiled(order)
    what = f"{what} compiled ({mode}), {' then '.join(order)}"
    error = ((ours.out - stock.out).norm() / stock.out.norm()).item()
    assert error < PRECISION["cpu"][2], f"{what}: relative error {error:.2e}"
    assert_compiles_as_often_as_stock(ours, stock, what)


def assert_compiles_as_often_as_stock(ours: CompiledTwice, stock: CompiledTwice, what: str) -> None:
    """No more graphs of diffusers' or the cache's code than stock, no more of them recompiled (a guard on
    xstage_dit's state), and a second call compiles no more than stock's (nothing recompiles per call). Not
    counted: the split's hooks, which compile as graphs of their own where a cache's graph break leaves them
    outside the model's graphs (a hook that splits at two sites, as CogVideoX's, compiles once for each)."""
    def theirs(graphs: list[Graph]) -> list[Graph]:
        return [graph for graph in graphs if not graph.ours]

    assert len(theirs(ours.first)) <= len(theirs(stock.first)), (what, ours.first, stock.first)
    recompiled = [sum(graph.recompiled for graph in theirs(run.first)) for run in (ours, stock)]
    assert recompiled[0] <= recompiled[1], (what, ours.first, stock.first)
    assert len(ours.second) <= len(stock.second), (what, ours.second, stock.second)


# three blocks of each kind on CPU (a first, a middle and a last one: a block instance that compiled anew would
# add a graph for each), tiny widths; the GPU's at real depth
DEEP = {
    "flux": (diffusers.FluxTransformer2DModel, {**zoo.ZOO["tiny-flux"].transformer, "num_layers": 3,
                                                 "num_single_layers": 3}),
    "wan": (diffusers.WanTransformer3DModel, {**zoo.ZOO["tiny-wan"].transformer, "num_layers": 3}),
    "flux2": (diffusers.Flux2Transformer2DModel, {**zoo.ZOO["tiny-flux2"].transformer, "num_layers": 3,
                                                   "num_single_layers": 3}),
    # head_dim 64: what the fused backend's kernels take (GPU)
    "flux-d64": (diffusers.FluxTransformer2DModel, {**zoo.ZOO["tiny-flux-d64"].transformer, "num_layers": 6,
                                                     "num_single_layers": 10}),
    "wan-d64": (diffusers.WanTransformer3DModel, {**zoo.ZOO["tiny-wan-d64"].transformer, "num_layers": 10}),
}


# (device, dtype, compiled vs eager, parallel vs one process): float32 on CPU; bf16 on a GPU, where the parallel
# run's attention kernels differ from stock's
PRECISION = {"cpu": (torch.float32, 1e-5, 1e-4), "cuda": (torch.bfloat16, 1e-3, 3e-2)}


def model_inputs(family: str, device: str = "cpu") -> dict:
    dtype = PRECISION[device][0]
    return {name: value.to(device, dtype) if torch.is_tensor(value) else value
            for name, value in _cpu_inputs(family).items()}


def _cpu_inputs(family: str) -> dict:
    generator = torch.Generator().manual_seed(1)
    if family.startswith("flux") and family != "flux2":
        tokens, text = 23, 8  # uneven image tokens over 2 ranks; the text splits over 2 and 4, not 3
        return dict(hidden_states=torch.randn(1, tokens, 16, generator=generator),
                    encoder_hidden_states=torch.randn(1, text, 32, generator=generator),
                    pooled_projections=torch.randn(1, 32, generator=generator), timestep=torch.tensor([0.5]),
                    guidance=torch.tensor([3.0]), img_ids=torch.randn(tokens, 3, generator=generator),
                    txt_ids=torch.zeros(text, 3), return_dict=False)
    if family == "flux2":
        tokens, text = 23, 8
        return dict(hidden_states=torch.randn(1, tokens, 16, generator=generator),
                    encoder_hidden_states=torch.randn(1, text, 32, generator=generator), timestep=torch.tensor([0.5]),
                    guidance=torch.tensor([3.0]), img_ids=torch.randn(1, tokens, 4, generator=generator),
                    txt_ids=torch.randn(1, text, 4, generator=generator), return_dict=False)
    return dict(hidden_states=torch.randn(1, 16, 3, 6, 10, generator=generator), timestep=torch.tensor([500]),
                encoder_hidden_states=torch.randn(1, 9, 32, generator=generator), return_dict=False)


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [*getattr(model, "transformer_blocks", []), *getattr(model, "single_transformer_blocks", []),
            *getattr(model, "blocks", [])]


def _compiled_graphs(model: torch.nn.Module, mode: str, inputs: dict) -> tuple[torch.Tensor, int]:
    """Compile `model` (fullgraph), call it twice; its output and how many graphs Dynamo compiled. Blocks that
    compile_repeated_blocks compiled in place are reset afterwards."""
    torch._dynamo.reset()
    counters.clear()
    compiled = model
    if mode == "blocks":
        model.compile_repeated_blocks(fullgraph=True, backend="eager")
    else:
        compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        out = compiled(**inputs)[0]
        again = compiled(**inputs)[0]  # reuses what the first call compiled
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    for block in repeated_blocks(model):
        block._compiled_call_impl = None
    return out, counters["stats"]["unique_graphs"]


def compile_and_compare(family: str, mode: str, extra_graphs: int, backend: str = "reference",
                         device: str = "cpu", degrees: dict | None = None) -> None:
    """Compiled with xstage_dit enabled: as many graphs as stock diffusers compiles (plus `extra_graphs`), equal
    to the eager output; after `disable` the stock model's output again."""
    cls, config = DEEP[family]
    dtype, compiled_tolerance, parallel_tolerance = PRECISION[device]
    torch.manual_seed(0)
    model = cls(**config).to(device, dtype).eval()
    inputs = model_inputs(family, device)
    with torch.no_grad():
        stock = model(**inputs)[0]
    _, stock_graphs = _compiled_graphs(model, mode, inputs)
    xstage_dit.enable(model, backend=backend, timeout_s=120, **(degrees or {}))
    with torch.no_grad():
        eager = model(**inputs)[0]
    out, graphs = _compiled_graphs(model, mode, inputs)
    assert graphs == stock_graphs + extra_graphs, f"{graphs} graphs compiled, stock diffusers {stock_graphs}"
    error = ((out - eager).float().norm() / eager.float().norm()).item()
    assert error < compiled_tolerance, f"compiled {family} ({mode}) differs from eager: {error:.2e}"
    if torch.distributed.is_initialized():
        error = ((eager - stock).float().norm() / stock.float().norm()).item()
        assert error < parallel_tolerance, f"{family}: parallel differs from one process by {error:.2e}"
    xstage_dit.disable(model)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs)[0], stock, rtol=0, atol=0)


def ranks_worker(family: str, mode: str, extra_graphs: int, degrees: dict | None = None) -> None:
    compile_and_compare(family, mode, extra_graphs, degrees=degrees)
