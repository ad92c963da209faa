"""One rank of a ring of N on one GPU: ring attention's step loop at T tokens per rank (24 heads of 128, bf16, pure
ring: every rank keeps all heads), six ways, each timed against the attention alone:

- alone: the N blocks' attention (cuDNN) and the log-sum-exp merge, nothing moved;
- alone_own: the blocks' attention with our kernel (kernels/attention.py), which merges each block's output into
  the running result itself, nothing moved;
- forwarding: alone_own with the kernel forwarding each block's key and value tiles into a second buffer (the
  stored ring's kernels without its own work around them: stacking the first block, the final cast);
- serial: each step attends its block, then sends it on (a copy in stream order);
- overlap: the send of each block in flight on a second stream while it attends (a copy-engine copy standing in
  for NCCL's point-to-point send, which needs a second GPU);
- stored: the X-Stage ring (sp/attention/ring.py `stored_ring_steps`) over a loopback fabric: our attention kernel
  forwards each key and value tile it loads into the next rank's slot (alone_own plus the forward stores).

Loopback: rank 0 of N simulated ranks; the other ranks' blocks are random rows already in rank 0's slots, its stores
go to rank 1's slot in this GPU's memory. It shows what the kernels and their stores cost beside the attention on
one GPU (SMs and HBM shared), not NVLink's drain, and nothing about scaling. Variants are timed in alternating
rounds, back to back (no L2 flush: a block is far larger than L2). Each row has the planner's prediction from this
GPU's loopback calibration beside it. Writes OUT.json and OUT.md; `--predict OUT.json` (CPU) re-makes an earlier
record's predictions from a calibration."""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from xstage_dit.burst_gap import AttentionShape, Calibration, Planner, find_calibration
from xstage_dit.burst_gap.ring_plan import RingBlocks
from xstage_dit.sp.attention.layout import UlyssesLayout
from xstage_dit.kernels.attention import flash_attention
from xstage_dit.kernels.attention_args import KeyForward, Merge, Running
from xstage_dit.sp.attention.ring import Merged, attention_with_lse, stored_ring_attention
from xstage_dit.sp.fabric import LoopbackFabric

from bench_kernels import back_to_back_ms
from provenance import described, provenance

RANKS = (2, 4, 8)
TOKENS = (8192, 16384, 32768, 65536)
HEADS, HEAD_DIM = 24, 128
ROUNDS, CALLS = 2, 3


class RingRank:
    """Rank 0 of a ring of `degree` at `tokens` tokens per rank, with its inputs and a loopback fabric."""

    def __init__(self, degree: int, tokens: int) -> None:
        def randn(*shape):
            return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

        self.layout = UlyssesLayout(text_len=0, seq_len=degree * tokens, local_len=tokens, degree=1, rank=0,
                                    text_first=True, text_queries=True, ring_degree=degree, ring_rank=0)
        self.query, self.key, self.value = (randn(1, tokens, HEADS, HEAD_DIM) for _ in range(3))
        self.block = torch.stack([self.key, self.value])
        self.fabric = LoopbackFabric(degree, "cuda", initialise=torch.Tensor.normal_).rank(0)
        self.side = torch.cuda.Stream()

    def _steps(self, send) -> torch.Tensor:
        merged = Merged(self.query)
        for step in range(self.layout.ring_degree):
            sent = send(self.block) if step + 1 < self.layout.ring_degree else None
            merged.add(attention_with_lse(self.query, self.block[0], self.block[1], None, None))
            if sent is not None:
                sent()
        return merged.out

    def _own_steps(self, forward: KeyForward | None) -> torch.Tensor:
        running = Running.empty(self.query)
        for _ in range(self.layout.ring_degree):
            flash_attention(self.query, self.block[0], self.block[1], epilogue=Merge(running), forward=forward)
        return running.out

    def alone(self) -> torch.Tensor:
        return self._steps(lambda block: None)

    def alone_own(self) -> torch.Tensor:
        return self._own_steps(None)

    def forwarding(self) -> torch.Tensor:
        to = torch.empty_like(self.block)
        return self._own_steps(KeyForward(to[0].data_ptr(), to[1].data_ptr()))

    def serial(self) -> torch.Tensor:
        def send(block):
            copy = torch.empty_like(block)
            return lambda: copy.copy_(block)  # after the attention, in stream order
        return self._steps(send)

    def overlap(self) -> torch.Tensor:
        def send(block):
            copy = torch.empty_like(block)
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                copy.copy_(block)
            return lambda: torch.cuda.current_stream().wait_stream(self.side)
        return self._steps(send)

    def stored(self) -> torch.Tensor:
        return stored_ring_attention(self.query, self.key, self.value, self.layout, self.fabric, None, None)


def predicted_ms(planner: Planner, degree: int, tokens: int) -> dict[str, float]:
    """The planner's time of each variant's steps (no Ulysses exchange or join around them: the rows have none)."""
    shape = AttentionShape(1, degree * tokens, 0, HEADS, HEAD_DIM, degree)
    around = planner.rings.ulysses_around(RingBlocks.of(shape, degree, 1))
    ring = {name: (planner.rings.call(shape, degree, 1, name) - around) * 1e3 for name in ("serial", "overlap")}
    blocks = RingBlocks.of(shape, degree, 1)
    own = sum(planner.rings.steps(blocks, own=True)) * 1e3
    return {"alone": sum(planner.rings.steps(blocks)) * 1e3, "alone_own": own,
            "forwarding": own + planner.rings.forward(blocks).added * 1e3 * degree, **ring,
            "stored": (planner.rings.call(shape, degree, 1, "fused") - around) * 1e3}


def with_predictions(records: list[dict], planner: Planner, calibration: Calibration) -> list[dict]:
    for r in records:
        r["predicted_ms"] = predicted_ms(planner, r["ring_degree"], r["tokens_per_rank"])[r["variant"]]
        r["calibration"] = calibration.filename
    return records


def bench(degrees: tuple[int, ...], tokens: tuple[int, ...]) -> list[dict]:
    records = []
    for n in degrees:
        for t in tokens:
            rank = RingRank(n, t)
            variants = {"alone": rank.alone, "alone_own": rank.alone_own, "forwarding": rank.forwarding,
                        "serial": rank.serial, "overlap": rank.overlap, "stored": rank.stored}
            for fn in variants.values():
                fn()
            samples = {name: [] for name in variants}
            for _ in range(ROUNDS):
                for name, fn in variants.items():
                    samples[name].append(back_to_back_ms(fn, CALLS))
            ms = {name: statistics.median(s) for name, s in samples.items()}
            for name in variants:
                records.append({"variant": name, "ring_degree": n, "tokens_per_rank": t, "heads": HEADS,
                                "head_dim": HEAD_DIM, "ms": ms[name], "vs_alone": ms[name] / ms["alone"],
                                "vs_alone_own": ms[name] / ms["alone_own"], "vs_serial": ms[name] / ms["serial"]})
            print(f"N={n} T={t}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()), flush=True)
            del rank
            torch.cuda.empty_cache()
    return records


def write(records: list[dict], prefix: Path) -> None:
    prefix.with_suffix(".json").write_text(json.dumps(records, indent=1) + "\n")
    env = records[0]
    source = (f"predicted: the planner from `{env['calibration']}`" if "calibration" in env
              else "no calibration: no predictions")
    lines = [f"# One rank of a ring, loopback: {env['card']}, {env['date']}", "",
             described(env) + " Rank 0 of N simulated on one GPU: the stores stay in this GPU's memory (no NVLink, no scaling); the "
             f"overlap row's send is a copy-engine copy on a second stream, standing in for NCCL's; {source}.", "",
             "| N | tokens per rank | variant | ms | vs alone | vs alone_own | vs serial | predicted ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        predicted = f"{r['predicted_ms']:.2f}" if "predicted_ms" in r else "-"
        own = f"{r['vs_alone_own']:.3f}" if "vs_alone_own" in r else "-"
        lines.append(f"| {r['ring_degree']} | {r['tokens_per_rank']} | {r['variant']} | {r['ms']:.2f} | "
                     f"{r['vs_alone']:.3f} | {own} | {r['vs_serial']:.3f} | {predicted} |")
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-ring")
    parser.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--calibration", type=Path, help="default: this GPU's loopback calibration, if any")
    parser.add_argument("--predict", type=Path, help="an earlier OUT.json: re-make its predictions, run nothing")
    args = parser.parse_args()
    card = json.loads(args.predict.read_text())[0]["card"] if args.predict else torch.cuda.get_device_name()
    calibration = (Calibration.load(args.calibration) if args.calibration
                   else find_calibration(card, 1, "loopback"))
    if args.predict:
        records = json.loads(args.predict.read_text())
    else:
        env = provenance()
        records = [{**r, **env} for r in bench(tuple(args.ranks), tuple(args.tokens))]
    if calibration is not None:
        records = with_predictions(records, Planner.from_calibration(calibration), calibration)
    write(records, args.predict.with_suffix("") if args.predict else Path(args.out))


if __name__ == "__main__":
    main()
