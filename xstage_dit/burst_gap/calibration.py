"""A machine's calibration: the fitted Burst-Gap model plus the measured kernel costs the planner needs, stored as
JSON keyed by GPU name, topology and world size (`xstage-dit calibrate` writes it, the planner reads it).

topology: "loopback" (peers simulated in one process: stores stay in local memory), "same-gpu" (several
processes on one GPU), "nvlink" or "pcie" (real peers)."""
from __future__ import annotations

import bisect
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .model import BurstGapModel


def calibration_dir() -> Path:
    return Path(os.environ.get("XSTAGE_CALIBRATION_DIR", Path.home() / ".cache" / "xstage_dit"))


def _interpolate(points: list[tuple[int, float]], at: int) -> float:
    """The measured value at `at`, interpolated in log(at) between the points (clamped outside their range)."""
    xs = [math.log(t) for t, _ in points]
    x = min(max(math.log(max(at, 1)), xs[0]), xs[-1])
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    (x0, y0), (x1, y1) = (xs[i - 1], points[i - 1][1]), (xs[i], points[i][1])
    return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class KernelCosts:
    """Measured on the machine: attention throughput of our kernel ("own") and the vendor's (cuDNN SDPA) by head
    dim at a few sequence lengths, device-to-device copy rate, all-to-all rate, one small kernel's cost; and the
    throughput of SwiGLU experts (both projections) by rows per expert, of our expert kernel ("own") and torch's
    grouped matmuls ("vendor"), empty in calibrations made before it was measured."""

    own_tflops: dict[int, list[tuple[int, float]]]  # head_dim -> [(tokens, TFLOP/s)], tokens ascending
    vendor_tflops: dict[int, list[tuple[int, float]]]
    copy_rate: float  # bytes copied per second
    alltoall_rate: float  # bytes per second leaving one rank in an all-to-all (a local copy in loopback)
    launch: float  # seconds
    sms: int
    expert_tflops: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # "own"/"vendor" -> [(rows, TF/s)]

    def attention_time(self, flops: float, tokens: int, head_dim: int, own: bool) -> float:
        """`flops` of attention over `tokens` keys at the measured throughput (the nearest measured head_dim
        stands in for others)."""
        table = self.own_tflops if own else self.vendor_tflops
        points = table[min(table, key=lambda d: abs(d - head_dim))]
        return self.launch + flops / (_interpolate(points, tokens) * 1e12)

    def expert_time(self, flops: float, rows_per_expert: float, own: bool) -> float:
        """`flops` of SwiGLU experts taking `rows_per_expert` rows each, at the measured throughput."""
        rate = _interpolate(self.expert_tflops["own" if own else "vendor"], round(rows_per_expert))
        return self.launch + flops / (rate * 1e12)

    def to_dict(self) -> dict:
        return {"own_tflops": {str(d): p for d, p in self.own_tflops.items()},
                "vendor_tflops": {str(d): p for d, p in self.vendor_tflops.items()},
                "copy_rate": self.copy_rate, "alltoall_rate": self.alltoall_rate, "launch": self.launch,
                "sms": self.sms, "expert_tflops": self.expert_tflops}

    @classmethod
    def from_dict(cls, data: dict) -> "KernelCosts":
        def table(raw: dict) -> dict[int, list[tuple[int, float]]]:
            return {int(d): sorted((int(t), float(r)) for t, r in points) for d, points in raw.items()}

        experts = {kind: sorted((int(r), float(t)) for r, t in points)
                   for kind, points in data.get("expert_tflops", {}).items()}
        return cls(table(data["own_tflops"]), table(data["vendor_tflops"]), float(data["copy_rate"]),
                   float(data["alltoall_rate"]), float(data["launch"]), int(data["sms"]), experts)


@dataclass
class Calibration:
    gpu: str
    topology: str
    world_size: int
    model: BurstGapModel
    costs: KernelCosts
    fit_error: dict[str, float]  # median and max relative error of the model over the samples
    samples: list[dict] = field(default_factory=list)  # the fit's inputs (BurstGapModel.fit records)
    visibility: list[dict] = field(default_factory=list)  # isolated bursts timed until visible
    meta: dict = field(default_factory=dict)  # date, versions, command

    @property
    def filename(self) -> str:
        return f"calibration-{slug(self.gpu)}-{self.topology}-n{self.world_size}.json"

    def to_dict(self) -> dict:
        return {"key": {"gpu": self.gpu, "topology": self.topology, "world_size": self.world_size},
                "model": self.model.to_dict(), "fit_error": self.fit_error, "kernel_costs": self.costs.to_dict(),
                "meta": self.meta, "samples": self.samples, "visibility": self.visibility}

    @classmethod
    def from_dict(cls, data: dict) -> "Calibration":
        key = data["key"]
        return cls(key["gpu"], key["topology"], int(key["world_size"]), BurstGapModel.from_dict(data["model"]),
                   KernelCosts.from_dict(data["kernel_costs"]), data.get("fit_error", {}), data.get("samples", []),
                   data.get("visibility", []), data.get("meta", {}))

    def save(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / self.filename
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: Path) -> "Calibration":
        """The calibration in `path`; a file that is not one raises ValueError naming it (OSError where it cannot
        be read)."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except KeyError as error:
            raise ValueError(f"{path} is not a calibration: it has no field {error}") from error
        except (ValueError, TypeError, AttributeError) as error:  # not JSON, or JSON of another shape
            raise ValueError(f"{path} is not a calibration JSON ({error})") from error


def slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-").removeprefix("nvidia-")


# store paths measured without a link between GPUs
SIMULATED = ("loopback", "same-gpu")

# calibrations measured by the project, shipped with the package: planning works out of the box on these GPUs
SHIPPED = Path(__file__).resolve().parent.parent / "calibrations"
SHIPPED_GPU = "NVIDIA H200"  # what they measured: `xstage-dit plan` plans for it on a machine without a GPU


def find_calibration(gpu: str, world_size: int, topology: str | None = None,
                     directory: Path | None = None) -> Calibration | None:
    """The calibration of this GPU kind that fits best: the same topology and world size if present, then the
    same topology, then any of this GPU (kernel costs carry over; the store path may not). `topology` None: ranks
    on GPUs of their own, whose store path a real link's calibration (nvlink, pcie) describes before a simulated
    one (loopback, same-gpu). Looks in `directory` only where one is given; else in this machine's calibration
    directory, then among the shipped ones."""
    for place in [directory] if directory else [calibration_dir(), SHIPPED]:
        found = [Calibration.load(p) for p in sorted(place.glob(f"calibration-{slug(gpu)}-*.json"))]
        if found:
            break
    else:
        return None

    def rank(c: Calibration) -> tuple[bool, int]:
        other = c.topology in SIMULATED if topology is None else c.topology != topology
        return (other, abs(c.world_size - world_size))

    return min(found, key=rank)
