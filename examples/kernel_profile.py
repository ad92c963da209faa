"""GPU time by kernel inside a pipeline call (bench_e2e --profile): where a step's time goes, per variant."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from provenance import described

NAME_CHARS = 80  # template-heavy kernel names are cut here (kernels sharing the cut name are summed)
TOP = 15  # kernels per table, by their largest time over the variants


def kernel_times(run: Callable[[], object], steps: int) -> dict[str, dict[str, float]]:
    """{kernel: {"ms_per_step", "calls_per_step"}} of the GPU work `run()` issues (a pipeline call of `steps`
    denoising steps)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels: dict[str, dict[str, float]] = {}
    for event in prof.key_averages():
        if event.self_device_time_total <= 0:
            continue
        entry = kernels.setdefault(event.key[:NAME_CHARS], {"ms_per_step": 0.0, "calls_per_step": 0.0})
        entry["ms_per_step"] += event.self_device_time_total / 1e3 / steps
        entry["calls_per_step"] += event.count / steps
    return dict(sorted(kernels.items(), key=lambda item: -item[1]["ms_per_step"]))


def write_profiles(records: list[dict], prefix: Path) -> None:
    """OUT-profile.json (the records) and OUT-profile.md: per config, the top kernels side by side."""
    prefix.with_name(prefix.name + "-profile.json").write_text(json.dumps(records, indent=1) + "\n")
    env = records[0]
    lines = [f"# GPU time by kernel per denoising step: {env['card']}, {env['date']}", "",
             described(env) + " One profiled call per variant, after the timed "
             "ones. Milliseconds of kernel time per step (calls per step).", ""]
    for config in dict.fromkeys(r["config"] for r in records):
        rows = [r for r in records if r["config"] == config]
        names = sorted({name for r in rows for name in r["kernels"]},
                       key=lambda name: -max(r["kernels"].get(name, {"ms_per_step": 0})["ms_per_step"] for r in rows))
        lines += [f"## {config}", "", f"`{rows[0]['command']}`", "",
                  "| kernel | " + " | ".join(r["variant"] for r in rows) + " |", "|---" * (len(rows) + 1) + "|"]
        for name in names[:TOP]:
            cells = [f"{k['ms_per_step']:.2f} ({k['calls_per_step']:.0f})" if (k := r["kernels"].get(name)) else "-"
                     for r in rows]
            lines.append(f"| `{name.replace('|', '/')}` | " + " | ".join(cells) + " |")
        lines.append("| all kernels | " + " | ".join(f"{r['gpu_ms_per_step']:.2f}" for r in rows) + " |")
        lines.append("")
    prefix.with_name(prefix.name + "-profile.md").write_text("\n".join(lines))
