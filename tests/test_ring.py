"""Sequence parallelism past the head count: ring attention (sp/attention/ring.py) and Ulysses inside each ring
step, on the mesh (cfg, ring, ulysses). The parallel result equals one process's (CPU, float32, < 1e-4)."""
from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from diffusers import FluxTransformer2DModel

import xstage_dit
from xstage_dit.testing import zoo
from cache_configs import STEPS, caches
from compile_checks import ranks_worker
from dist_harness import run_on_ranks
from gpu_checks import same_gpu_worker
from numerics import relative_error
from pipeline_checks import SIZES, TOLERANCE, bare_transformer_inputs, per_pipeline, pipeline_worker
from vae_checks import rows_seen
from xstage_dit import api
from xstage_dit.config import XStageConfig
from xstage_dit.runtime.distributed import build_groups, ensure_process_group, free_port

# the library's CPU paths (conftest.py): these tests' subject is not our kernels, which their own tests run
pytestmark = pytest.mark.cpu_paths


@pytest.mark.parametrize("world, given, heads, node, expected", [
    (4, {}, [6], 4, (2, 2)),        # 6 heads: Ulysses 2 is the widest that splits them
    (4, {}, [5], 4, (1, 4)),        # 5 heads: a ring of 4
    (8, {}, [12], 8, (4, 2)),
    (8, {}, [24], 4, (4, 2)),       # Ulysses stays inside a node of 4
    (16, {}, [24], 8, (8, 2)),      # 2 nodes x 8 GPUs
    (8, {"cfg_degree": 2}, [30], 4, (2, 2)),
    (4, {"ulysses_degree": 2}, [12], 4, (2, 2)),
    (4, {"ring_degree": 4}, [12], 4, (1, 4)),
    (4, {}, [12], 4, (4, 1)),       # Ulysses alone where it splits the heads
])
def test_the_degrees_the_job_runs(monkeypatch, world, given, heads, node, expected):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(node))
    degrees = api._degrees(world, XStageConfig(**given), heads)
    assert (degrees.ulysses, degrees.ring) == expected


@pytest.mark.parametrize("given, message", [
    ({"ulysses_degree": 3}, r"ulysses_degree=3 does not fit the world size 4: .* so it must divide 4$"),
    ({"ring_degree": 3}, r"ring_degree=3 does not fit the world size 4"),
    ({"ulysses_degree": 2, "ring_degree": 1}, r"ulysses_degree=2 x ring_degree=1 does not fit .* must be 4$"),
])
def test_degrees_that_do_not_fit_are_refused(given, message):
    with pytest.raises(ValueError, match=message):
        api._degrees(4, XStageConfig(**given), [12])


def _mesh_worker() -> None:
    """Each split's groups, from one device mesh, against the layout rank = (c R + r) U + u; each group's collectives
    bounded by enable's timeout, not the default group's."""
    ensure_process_group(120.0)
    for cfg, ring, ulysses in ((1, 2, 2), (2, 1, 2), (2, 2, 1), (1, 4, 1)):
        groups = build_groups(cfg, ulysses, 37.0, ring)
        c, r, u = groups.cfg_rank, groups.ring_rank, groups.ulysses_rank
        assert dist.get_rank() == (c * ring + r) * ulysses + u
        assert groups.mesh.mesh_dim_names == ("cfg", "ring", "ulysses")
        expected = {"ulysses_group": [(c * ring + r) * ulysses + k for k in range(ulysses)],
                    "ring_group": [(c * ring + k) * ulysses + u for k in range(ring)],
                    "cfg_group": [(k * ring + r) * ulysses + u for k in range(cfg)],
                    "sequence_group": [c * ring * ulysses + k for k in range(ring * ulysses)]}
        for name, ranks in expected.items():
            group = getattr(groups, name)
            assert (group is None) == (len(ranks) == 1), (name, cfg, ring, ulysses)
            if group is not None:
                assert dist.get_process_group_ranks(group) == ranks, (name, cfg, ring, ulysses)
                assert group._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=37)
    # the mesh's groups are made by their members alone: a rank done early must not take the store, which rank 0
    # hosts, away from ranks still making theirs
    dist.barrier()


def test_the_groups_come_from_one_device_mesh_with_enables_timeout() -> None:
    run_on_ranks(4, _mesh_worker)


def _heads_worker() -> None:
    """Models whose head counts 4 ranks cannot split by Ulysses alone: the degrees are chosen by themselves."""
    for heads, expected in ((6, (2, 2)), (5, (1, 4))):
        torch.manual_seed(0)
        model = FluxTransformer2DModel(**{**zoo.ZOO["tiny-flux"].transformer, "num_attention_heads": heads}).eval()
        inputs = bare_transformer_inputs("tiny-flux", torch.Generator().manual_seed(3))
        with torch.no_grad():
            ref = model(**inputs).sample
            xstage_dit.enable(model, backend="reference", timeout_s=120)
            config = model._xstage_dit_applied.config
            out = model(**inputs).sample
        assert (config.ulysses_degree, config.ring_degree) == expected, config
        error = relative_error(out, ref)
        assert error < TOLERANCE, f"{heads} heads as {expected}: relative error {error:.2e}"
        xstage_dit.disable(model)


def test_heads_that_ulysses_cannot_split_run_on_a_ring() -> None:
    run_on_ranks(4, _heads_worker)


# every family over 4 ranks, as a ring of 4 and as Ulysses 2 x ring 2 (uneven tokens, batch 2: the one case of each;
# Z-Image through its ControlNet pipeline, which runs its transformer and its ControlNet)
FAMILIES = ["tiny-flux", "tiny-wan", "tiny-qwenimage", "tiny-flux2", "tiny-hunyuan-video", "tiny-ltx", "tiny-sd3.5",
            "tiny-cogvideox", "tiny-hidream", "tiny-nucleusmoe", "tiny-zimage-controlnet", "tiny-ltx2",
            "tiny-hunyuan-video15", "tiny-wan-vace", "tiny-qwenimage21", "tiny-chroma"]
RING_DEGREES = {"ring-4": {"ring_degree": 4}, "ulysses-2-ring-2": {"ulysses_degree": 2, "ring_degree": 2}}


@pytest.mark.parametrize("degrees, name", per_pipeline({"ring-4": FAMILIES, "ulysses-2-ring-2": FAMILIES}))
def test_every_family_on_a_ring_matches_single_process(degrees: str, name: str) -> None:
    run_on_ranks(4, pipeline_worker, name, 1, 3.0, "reference", False, None, RING_DEGREES[degrees])


@pytest.mark.parametrize("name", ["tiny-flux", "tiny-wan"])
def test_cfg_parallel_around_a_ring_matches_single_process(name: str) -> None:
    """cfg_degree=2 x ring_degree=2: each CFG group's two ranks hold one sequence as a ring."""
    run_on_ranks(4, pipeline_worker, name, 2, 3.0, "reference", False, False, {"ring_degree": 2})


HYBRID = {"ulysses_degree": 2, "ring_degree": 2}


def _combined_worker() -> None:
    """Ulysses 2 x ring 2 with what users combine: NucleusMoE's expert choice with its experts sharded over the
    sequence's ranks; a diffusers cache (enabled before enable) and the row-split VAE decode in one generation."""
    pipeline_worker("tiny-nucleusmoe", 1, 3.0, "reference", True, None, HYBRID)
    pipe = zoo.build_pipeline("tiny-flux")
    pipe.set_progress_bar_config(disable=True)

    def generate() -> torch.Tensor:
        kwargs = zoo.call_kwargs("tiny-flux", **SIZES["tiny-flux"]["uneven"], steps=STEPS, guidance=1.0)
        return pipe(**kwargs, **zoo.text_embeddings("tiny-flux", 1, seed=2), output_type="pt",
                    generator=torch.Generator().manual_seed(8), return_dict=False)[0]

    rows = rows_seen(pipe.vae)
    pipe.transformer.enable_cache(caches(pipe, "tiny-flux")["FirstBlockCache"][1]())
    stock = generate()
    whole = max(rows)
    xstage_dit.enable(pipe, backend="reference", timeout_s=120, **HYBRID)
    rows.clear()
    error = relative_error(generate(), stock)
    assert error < TOLERANCE, f"a cache and the decode on Ulysses 2 x ring 2: relative error {error:.2e}"
    assert max(rows) < whole, f"the decoder saw {rows} of {whole} latent rows"
    xstage_dit.disable(pipe)
    pipe.transformer.disable_cache()


def test_experts_the_decode_and_caches_on_a_ring_match_single_process() -> None:
    run_on_ranks(4, _combined_worker, deadline_s=600)


def test_compiled_blocks_on_a_ring_compile_as_often_as_under_ulysses() -> None:
    """compile_repeated_blocks(fullgraph=True) with three blocks of each kind, Ulysses 2 x ring 2: as many graphs as
    stock, compiled equal to eager, eager equal to one process."""
    run_on_ranks(4, ranks_worker, "flux", "blocks", 0, {"ulysses_degree": 2, "ring_degree": 2}, deadline_s=600)


@pytest.mark.gpu
@pytest.mark.parametrize("name, world_size, degrees", [
    ("tiny-flux-d64", 2, {"ring_degree": 2}), ("tiny-flux-d64", 4, {"ulysses_degree": 2, "ring_degree": 2}),
    ("tiny-wan-d64", 4, {"ring_degree": 4}), ("tiny-nucleusmoe", 4, {"ulysses_degree": 2, "ring_degree": 2}),
])
def test_a_ring_of_ranks_sharing_one_gpu_matches_one_gpu(name, world_size, degrees) -> None:
    """bf16 on one GPU (gloo between the processes), against the same pipeline on one GPU, within the tolerance
    of tests/test_gpu.py's same-GPU tests."""
    run_on_ranks(world_size, same_gpu_worker, name, "auto", None, None, degrees, deadline_s=300)


def test_two_nodes_run_ulysses_inside_and_a_ring_across() -> None:
    """Two torchrun agents on this machine (--nnodes 2 --nproc-per-node 2, c10d rendezvous on localhost): with no
    degrees given, Ulysses spans each pretend node's 2 ranks and the ring the 2 nodes; equal to one process."""
    port = free_port()
    job = Path(__file__).with_name("two_node_job.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "xstage-two-nodes",
               "--max-restarts", "0", str(job)]
    repository = str(Path(__file__).resolve().parents[1])  # the checkout under test, not an installed copy
    environment = {**os.environ, "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [repository, os.environ.get("PYTHONPATH")]))}
    agents = [subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True) for _ in range(2)]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=300)[0])
    finally:
        for agent in agents:
            agent.kill()
    assert all(agent.returncode == 0 for agent in agents), "\n".join(outputs)[-3000:]
    assert "two nodes: ulysses 2 x ring 2" in "".join(outputs), "\n".join(outputs)[-3000:]
