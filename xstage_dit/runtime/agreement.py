"""Ranks that must make the same calls check that they do, in one small collective, before acting on it: a rank
with other weights, arguments or inputs would otherwise return silently wrong results, or hang in a collective
the others never join."""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .distributed import all_gather_into, local_device, waiting_for


@dataclass
class Fingerprint:
    """Named numbers every rank must agree on (strings, tuples and None enter as the CRC-32 of their text)."""

    names: list[str] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def add(self, name: str, value: object) -> None:
        self.names.append(name)
        if value is None or isinstance(value, (str, tuple)):
            self.values.append(float(zlib.crc32(str(value).encode())))
        else:
            self.values.append(float(value))  # type: ignore[arg-type]


def stored_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold `tensor`'s values, detached: itself as a plain tensor, or, for a wrapper
    subclass (torchao's quantized weights: Int8Tensor's qdata, scale and zero point, Float8Tensor's qdata and
    scale), its inner tensors, recursively. Reading these rather than the subclass needs none of its operators
    (torchao's tensors have no `sum`; GGUF's parameters re-wrap every result as GGUF data) and no dequantized
    copy, and it sees exactly the bytes the model computes with."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return [inner for name in names for inner in stored_tensors(getattr(tensor, name))]
    with torch._C.DisableTorchFunctionSubclass():  # a subclass's own __torch_function__ is not asked
        return [tensor.detach()]


def tensors_checksum(tensors: Iterable[torch.Tensor]) -> float:
    """The sum of the values `tensors` store (`stored_tensors`: a quantized weight's data and scales) in float64
    (one pass over them, one host sync); tensors without storage (meta) are left out."""
    stored = [inner for t in tensors for inner in stored_tensors(t) if inner.device.type != "meta"]
    if not stored:
        return 0.0
    return float(sum(t.sum(dtype=torch.float64) for t in stored))


def weights_checksum(module: torch.nn.Module) -> float:
    """The float64 sum of every parameter and buffer of `module` (of what they store: `stored_tensors`)."""
    return tensors_checksum((*module.parameters(), *module.buffers()))


def weight_kinds(module: torch.nn.Module) -> str:
    """The classes and dtypes `module`'s parameters come in, e.g. "Int8Tensor float32, Parameter float32": ranks
    whose models are quantized differently (or on one rank only) disagree on it even where their sums might not."""
    return ", ".join(sorted({f"{type(p).__name__} {p.dtype}" for p in module.parameters()}))


def call_fingerprint(arguments: dict[str, Any]) -> Fingerprint:
    """What the ranks must agree on about one pipeline call: every argument but `self` and callables, tensors
    by shape, dtype and float64 sum (one host sync for all of them), generators by their state, the global
    random state where no generator is given."""
    fingerprint = Fingerprint()
    sums: list[tuple[str, torch.Tensor]] = []
    for name, value in arguments.items():
        if name != "self":
            _describe(fingerprint, sums, name, value)
    if arguments.get("generator", "absent") is None:
        _add_state(fingerprint, "global random state (no generator given)", torch.get_rng_state())
        if torch.cuda.is_initialized():
            _add_state(fingerprint, "global CUDA random state (no generator given)", torch.cuda.get_rng_state())
    if sums:
        totals = torch.stack([total.to(sums[0][1].device) for _, total in sums]).tolist()
        for (name, _), total in zip(sums, totals):
            fingerprint.add(f"{name} (sum)", total)
    return fingerprint


def _describe(fingerprint: Fingerprint, sums: list[tuple[str, torch.Tensor]], name: str, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        fingerprint.add(f"{name} (shape, dtype)", f"{tuple(value.shape)} {value.dtype}")
        sums.append((name, value.detach().sum(dtype=torch.float64)))
    elif isinstance(value, torch.Generator):
        _add_state(fingerprint, f"{name} (state)", value.get_state())
    elif isinstance(value, (list, tuple)):
        fingerprint.add(f"{name} (length)", len(value))
        for index, item in enumerate(value):
            _describe(fingerprint, sums, f"{name}[{index}]", item)
    elif isinstance(value, dict):
        fingerprint.add(f"{name} (keys)", ",".join(map(str, value)))
        for key, item in value.items():
            _describe(fingerprint, sums, f"{name}[{key!r}]", item)
    elif isinstance(value, (bool, int, float)):
        fingerprint.add(name, value)
    elif not callable(value):
        fingerprint.add(name, f"{type(value).__name__} {value}" if value is None or isinstance(value, str)
                        else f"{type(value).__name__} {getattr(value, 'size', '')}")


def _add_state(fingerprint: Fingerprint, name: str, state: torch.Tensor) -> None:
    fingerprint.add(name, float(zlib.crc32(state.numpy().tobytes())))


def check_agreement(fingerprint: Fingerprint, what: str, group: dist.ProcessGroup | None = None,
                    relative_tolerance: float = 1e-9) -> None:
    """Every rank of `group` (default: the default group) compares its fingerprint with everyone's, first which
    values it has, then the values; on a difference every rank raises the same error, naming the first rank that
    differs from rank 0 and the first value it differs in."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    shape = Fingerprint()
    shape.add("number of values", len(fingerprint.values))
    shape.add("names of values", "|".join(fingerprint.names))
    difference = _first_difference(shape, group, 0.0, what)
    if difference is not None:
        raise ValueError(f"xstage_dit: the ranks disagree on {what}: rank {difference[0]} passes other arguments "
                         f"than rank 0 (its {difference[1]}); every rank must make the same call on the same model "
                         "and inputs")
    difference = _first_difference(fingerprint, group, relative_tolerance, what)
    if difference is not None:
        raise ValueError(f"xstage_dit: the ranks disagree on {what}: rank {difference[0]}'s {difference[1]} differs "
                         "from rank 0's; every rank must make the same call on the same model and inputs")


def _first_difference(fingerprint: Fingerprint, group: dist.ProcessGroup | None, relative_tolerance: float,
                      what: str) -> tuple[int, str] | None:
    """Gathered from every rank (one collective): the first rank that differs from rank 0 and the name of its
    first differing value, or None when all agree (NaN agrees with NaN). A peer that never comes (dead, or past
    the group's timeout) raises naming this rank and what it waited to compare."""
    mine = torch.tensor(fingerprint.values, dtype=torch.float64, device=local_device())
    size = dist.get_world_size(group)
    everyone = mine.new_empty(size * mine.numel())
    with waiting_for(f"the other ranks to agree on {what}"):
        all_gather_into(everyone, mine, group)
    rows = everyone.view(size, -1).tolist()
    for rank, row in enumerate(rows[1:], start=1):
        for name, first, theirs in zip(fingerprint.names, rows[0], row):
            both_nan = math.isnan(first) and math.isnan(theirs)
            if not both_nan and not math.isclose(first, theirs, rel_tol=relative_tolerance, abs_tol=0.0):
                return rank, name
    return None
