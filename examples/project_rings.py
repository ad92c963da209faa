"""A projection, not a measurement: the attention layers of Z-Image 1024² and Wan 2.1 14B 720p per denoising step
on 8 GPUs (one node) and on 2 x 8 GPUs, for every Ulysses x ring split the heads allow, as the Burst-Gap planner
predicts them from the shipped H200 calibration (`Planner.layer_splits`). Runs on CPU. Between nodes the ring's
sends run at --internode-gbps, an assumption (no calibration measures the network). Only the attention layers
with their communication are projected: no projections, MLPs, VAE or host time.

    python examples/project_rings.py --out docs/benchmarks/projection-rings-h200
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from provenance import provenance, write_records

from xstage_dit.burst_gap.calibration import SHIPPED, SHIPPED_GPU, find_calibration
from xstage_dit.burst_gap.planner import Planner, widest_ulysses
from xstage_dit.burst_gap.ring_plan import INTERNODE_RATE, Nodes
from xstage_dit.burst_gap.ulysses_plan import AttentionShape
from xstage_dit.sp.attention.backends import backends, costs_of


@dataclass(frozen=True)
class Layers:
    """Attention layers of one shape in a model's denoising step."""

    what: str
    count: int
    text_tokens: int


@dataclass(frozen=True)
class Model:
    name: str
    size: str
    image_tokens: int
    heads: int
    head_dim: int
    layers: tuple[Layers, ...]


MODELS = (
    # 1024² -> a 128 x 128 latent in 2 x 2 patches; the caption (here 128 tokens) joins the main layers' sequence
    Model("Z-Image", "1024²", 64 * 64, 30, 128, (Layers("main layers, [image, caption]", 30, 128),
                                                  Layers("noise refiner, image alone", 2, 0))),
    # 720 x 1280 x 81 frames -> 21 x 90 x 160 latent in 1 x 2 x 2 patches; the text is only cross-attended (local)
    Model("Wan 2.1 14B", "720×1280×81", 21 * 45 * 80, 40, 128, (Layers("self-attention", 40, 0),)),
)

JOBS = ((8, 8), (16, 8))  # (ranks, ranks per node): one node of 8, two nodes of 8


def project(planner: Planner, model: Model, ranks: int, nodes: Nodes) -> list[dict]:
    """One row per split and backend: the step's attention time, the planner's pick marked."""
    costs = costs_of(tuple(backends()))
    totals: dict[tuple[int, int, str], float] = {}
    for layers in model.layers:
        shape = AttentionShape(1, model.image_tokens, layers.text_tokens, model.heads, model.head_dim, ranks)
        for split in planner.layer_splits(shape, nodes, costs):
            key = (split.ulysses, split.ring, split.backend)
            totals[key] = totals.get(key, 0.0) + layers.count * split.seconds
    picked = min(totals, key=totals.__getitem__)
    default = widest_ulysses(ranks, [model.heads], nodes.ranks_per_node)
    return [{"model": model.name, "size": model.size, "tokens": model.image_tokens, "heads": model.heads,
             "layers": "; ".join(f"{layers.count} {layers.what} (text {layers.text_tokens})"
                                 for layers in model.layers),
             "ranks": ranks, "ranks_per_node": nodes.ranks_per_node, "internode_gbps": nodes.internode_rate * 8e-9,
             "ulysses": ulysses, "ring": ring, "backend": backend, "attention_ms_per_step": seconds * 1e3,
             "picked": (ulysses, ring, backend) == picked, "enable_default": ulysses == default}
            for (ulysses, ring, backend), seconds in sorted(totals.items(), key=lambda item: item[1])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("projection-rings-h200"), help="output prefix (.json, .md)")
    parser.add_argument("--internode-gbps", type=float, default=INTERNODE_RATE * 8e-9)
    args = parser.parse_args()
    calibration = find_calibration(SHIPPED_GPU, 8, directory=SHIPPED)
    planner = Planner.from_calibration(calibration)
    where = provenance()
    records = []
    for model in MODELS:
        for ranks, per_node in JOBS:
            nodes = Nodes(per_node, args.internode_gbps * 1e9 / 8)
            records += [{**row, **where, "card": f"{SHIPPED_GPU} (projected)", "computed_on": where["card"],
                         "calibration": calibration.filename, "projection": True}
                        for row in project(planner, model, ranks, nodes)]
    table = ["| model | size | tokens | GPUs | Ulysses x ring | backend | attention per step (ms, projected) | "
             "planner's pick | enable's default split |", "|---|---|---|---|---|---|---|---|---|"]
    table += [f"| {r['model']} | {r['size']} | {r['tokens']} | {_gpus(r)} | {r['ulysses']} x {r['ring']} | "
              f"{r['backend']} | {r['attention_ms_per_step']:.2f} | {'yes' if r['picked'] else ''} | "
              f"{'yes' if r['enable_default'] else ''} |" for r in records]
    method = (f"**A projection, not measured**: computed on a machine without a GPU by the Burst-Gap planner "
              f"(`Planner.layer_splits`) from the shipped calibration {calibration.filename} (NVLink, measured "
              f"with 2 ranks: 8 and 16 extrapolate its store path to more peers). Between nodes the ring's sends "
              f"run at {args.internode_gbps:.0f} Gb/s a rank, an assumption. Only the attention layers with their "
              f"communication, per denoising step (layers: Z-Image {MODELS[0].layers[0].count} + "
              f"{MODELS[0].layers[1].count}, Wan {MODELS[1].layers[0].count}); batch 1, no CFG. With a ring, "
              f"`reference` is the ring whose blocks travel by NCCL point-to-point (overlapped) and `fused` the "
              f"X-Stage ring (within a node only); without one, the Ulysses backends.")
    write_records(records, args.out, "Projection (not measured): Z-Image and Wan 2.1 14B attention, U x R", method,
                  table)


def _gpus(record: dict) -> str:
    nodes = record["ranks"] // record["ranks_per_node"]
    return str(record["ranks"]) if nodes == 1 else f"{nodes} x {record['ranks_per_node']}"


if __name__ == "__main__":
    main()
