"""A patched transformer compiles region by region (diffusers' compile_repeated_blocks) with no graph break in
the attention path: Ulysses attention is one custom op (xstage::ulysses_attention). fullgraph=True turns any
graph break into an error; the eager compile backend keeps the test fast on CPU."""
from __future__ import annotations

import pytest
import torch

import xstage_dit
import zoo
from dist_harness import run_on_ranks


def _compiled_worker(name: str, backend: str) -> None:
    pipe = zoo.build_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    entry = zoo.ZOO[name]
    kwargs = zoo.call_kwargs(name, height=entry.height, width=entry.width, num_frames=entry.num_frames, steps=2,
                             guidance=3.0)

    def generate():
        return pipe(**kwargs, **zoo.text_embeddings(name, 1, seed=0), output_type="latent",
                    generator=torch.Generator().manual_seed(0), return_dict=False)[0]

    stock = generate()
    xstage_dit.enable(pipe, backend=backend, timeout_s=120)
    pipe.transformer.compile_repeated_blocks(fullgraph=True, backend="eager")
    out = generate()
    error = ((out - stock).norm() / stock.norm()).item()
    assert error < 1e-4, f"compiled {name}: relative error {error:.2e}"


@pytest.mark.parametrize("name, backend", [("tiny-flux", "reference"), ("tiny-wan", "overlap")])
def test_compiled_blocks_have_no_graph_break(name, backend):
    run_on_ranks(2, _compiled_worker, name, backend)
