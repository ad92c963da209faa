"""What the rank-agreement checks cost (enable(check_inputs=True), the default): at every pipeline call, the
fingerprint of the call's arguments and its collective, timed inside real pipeline calls; at `enable`, the
checksum of the weights and its collective, as enable's time with the check against without it.

    torchrun --nproc_per_node 2 examples/bench_check.py --config flux-dev --out docs/benchmarks/check-h200x2

Random weights, real configs (xstage_dit/testing/zoo.py). Times are rank 0's; each per-call sample starts on an idle
GPU (what the check waits for is its own work, not the previous call's). Writes OUT.json and OUT.md on the main rank."""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import xstage_dit
from xstage_dit.testing import zoo
from provenance import OUTPUT_DIR, provenance, write_records
from xstage_dit import layers
from xstage_dit.runtime import ensure_process_group


class CheckTimer:
    """Times the pipeline-call check where enable's call wrapper runs it (layers.call_fingerprint, then
    layers.check_agreement); `remove()` puts both back."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.samples = device, []
        self._fingerprint, self._check = layers.call_fingerprint, layers.check_agreement
        self._start = 0.0

        def fingerprint(arguments):
            self._sync()
            self._start = time.perf_counter()
            return self._fingerprint(arguments)

        def check(*args, **kwargs):
            self._check(*args, **kwargs)
            self._sync()
            self.samples.append(time.perf_counter() - self._start)

        layers.call_fingerprint, layers.check_agreement = fingerprint, check

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def remove(self) -> None:
        layers.call_fingerprint, layers.check_agreement = self._fingerprint, self._check


def time_enable(pipe, check_inputs: bool, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    xstage_dit.enable(pipe, backend="reference", check_inputs=check_inputs)
    seconds = time.perf_counter() - start
    xstage_dit.disable(pipe)
    return seconds


def bench(name: str, repeats: int, device: torch.device, dtype: torch.dtype) -> dict:
    pipe = zoo.build_pipeline(name, device=device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    entry = zoo.ZOO[name]
    call = zoo.call_kwargs(name, height=entry.height, width=entry.width, num_frames=entry.num_frames, steps=1,
                           guidance=1.0)
    call.update(zoo.text_embeddings(name, 1, seed=0, device=device, dtype=dtype), output_type="latent")
    enable_s: dict[bool, list[float]] = {True: [], False: []}
    for round_ in range(repeats + 1):  # round 0 warms up (groups, allocator)
        for checked in (True, False) if round_ % 2 else (False, True):
            seconds = time_enable(pipe, checked, device)
            if round_:
                enable_s[checked].append(seconds)
    xstage_dit.enable(pipe, backend="reference")
    timer = CheckTimer(device)
    for _ in range(repeats + 1):
        pipe(**call, generator=torch.Generator().manual_seed(0))
    timer.remove()
    xstage_dit.disable(pipe)
    checked, unchecked = (statistics.median(enable_s[c]) for c in (True, False))
    per_call = statistics.median(timer.samples[1:])
    return {"config": name, "ranks": torch.distributed.get_world_size(), "repeats": repeats,
            "call_check_ms": per_call * 1e3, "call_check_ms_all": [s * 1e3 for s in timer.samples],
            "enable_checked_s": checked, "enable_unchecked_s": unchecked, "enable_check_s": checked - unchecked,
            **provenance()}


def write(records: list[dict], prefix: Path) -> None:
    table = ["| config | check per pipeline call (ms) | enable with check (s) | enable without (s) | "
             "check at enable (s) |", "|---|---|---|---|---|"]
    for r in records:
        table.append(f"| {r['config']} | {r['call_check_ms']:.2f} | {r['enable_checked_s']:.3f} | "
                     f"{r['enable_unchecked_s']:.3f} | {r['enable_check_s']:.3f} |")
    write_records(records, prefix, "Rank-agreement checks", f"Medians of {records[0]['repeats']}; rank 0's times.",
                  table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", nargs="+", default=["tiny-flux"], choices=sorted(zoo.ZOO))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=f"{OUTPUT_DIR}/bench-check",
                        help="output path prefix (.json, .md)")
    args = parser.parse_args()
    device = xstage_dit.local_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ensure_process_group(timeout_s=600)
    records = [bench(name, args.repeats, device, dtype) for name in args.config]
    if xstage_dit.is_main_process():
        write(records, args.out)


if __name__ == "__main__":
    main()
