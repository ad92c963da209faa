"""Ranks that must make the same calls check that they do, in one small collective, before acting on it: a rank
with other weights, arguments or inputs would otherwise return silently wrong results, or hang in a collective
the others never join."""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .distributed import all_gather_into, local_device


@dataclass
class Fingerprint:
    """Named numbers every rank must agree on (strings enter as their CRC-32)."""

    names: list[str] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def add(self, name: str, value: object) -> None:
        self.names.append(name)
        if isinstance(value, str):
            self.values.append(float(zlib.crc32(value.encode())))
        else:
            self.values.append(float(value))  # type: ignore[arg-type]


def weights_checksum(module: torch.nn.Module) -> float:
    """The sum of every parameter and buffer in float64 (one pass over the weights, one host sync); tensors
    without storage (meta) are left out."""
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.device.type != "meta"]
    if not tensors:
        return 0.0
    return float(sum(t.detach().sum(dtype=torch.float64) for t in tensors))


def check_agreement(fingerprint: Fingerprint, what: str, relative_tolerance: float = 1e-9) -> None:
    """Every rank of the default group compares its fingerprint with everyone's; on a difference every rank
    raises the same error, naming the first rank that differs from rank 0 and the first value it differs in."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = torch.tensor(fingerprint.values, dtype=torch.float64, device=local_device())
    everyone = mine.new_empty(dist.get_world_size() * mine.numel())
    all_gather_into(everyone, mine, None)
    rows = everyone.view(dist.get_world_size(), -1).tolist()
    for rank, row in enumerate(rows[1:], start=1):
        for name, first, theirs in zip(fingerprint.names, rows[0], row):
            if not math.isclose(first, theirs, rel_tol=relative_tolerance, abs_tol=0.0):
                raise ValueError(f"xstage_dit: the ranks disagree on {what}: rank {rank}'s {name} differs from "
                                 f"rank 0's; every rank must make the same call on the same model and inputs")
