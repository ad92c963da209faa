"""The one record of user-facing knobs: what `xstage_dit.enable` is asked for, checked when it is made."""
from __future__ import annotations

import importlib.util
import math
import numbers
from dataclasses import dataclass, fields
from typing import Any


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


FP8_PARTS = ("attention", "linear", "payloads")
# `backend`'s values, each the name of its module in sp/attention/, with the package it needs besides the package's
# own dependencies (None: none); the registry (sp/attention/backends.py) loads them in this order, and the command
# lines offer them without importing the registry (torch and the kernels)
BACKENDS: dict[str, str | None] = {"reference": None, "overlap": None, "fused": "triton", "auto": None}


def installed_backends() -> list[str]:
    """The backends whose packages are installed, as `xstage_dit.available_backends()` lists them, found without
    importing anything."""
    return sorted(name for name, package in BACKENDS.items()
                  if package is None or importlib.util.find_spec(package) is not None)


def fp8_parts(value: Any) -> tuple[str, ...]:
    """`XStageConfig.fp8` as given (None, "all", one part's name or several) as the parts in FP8_PARTS' order;
    anything else raises in words."""
    if value is None:
        return ()
    names = FP8_PARTS if value == "all" else (value,) if isinstance(value, str) else value
    try:
        names = tuple(names)
    except TypeError:
        names = (value,)
    unknown = [name for name in names if not isinstance(name, str) or name not in FP8_PARTS]
    if unknown:
        raise ValueError(f"fp8 must be None, \"all\" or parts among {', '.join(map(repr, FP8_PARTS))}, got "
                         f"{value!r}")
    return tuple(part for part in FP8_PARTS if part in names)


@dataclass(frozen=True)
class XStageConfig:
    """What `xstage_dit.enable` runs with. Made by the user (`enable(pipe, config=XStageConfig(...))`) or from
    `enable`'s keywords (`enable(pipe, cfg_degree=2)` is `enable(pipe, config=XStageConfig(cfg_degree=2))`); each
    value's type and range is checked here, and `enable` resolves the defaults that depend on the job (`None`) before
    any collective.

    ulysses_degree: ranks that split one sequence's heads (Ulysses sequence parallelism); None: see ring_degree.
    ring_degree: Ulysses groups that split one sequence further as a ring (ring attention: the keys and values
        travel around the ring, sp/attention/ring.py), the Ulysses groups innermost (consecutive ranks, one node);
        None with ulysses_degree None: the planner picks both from the world, the heads and the node size (Ulysses
        as wide as divides the heads within a node, the ring for the rest), else world / cfg_degree / ulysses.
    backend: how Ulysses moves data: one of BACKENDS; see `xstage_dit.available_backends()`.
    timeout_s: bound on every cross-rank wait; a wait past it raises instead of hanging.
    fuse_rope: the patched attention's diffusers `apply_rotary_emb` calls run our one-pass RoPE kernel (GPU); in
        Flux and Chroma the q/k RMSNorms before it run in the same pass (patches/image/flux.py NormRopeProcessor),
        and in Wan the q/k norms and rotation are handed to the fused backend's stores.
    fuse_mlp: the feed-forwards' tanh-GELU runs in its GEMM's epilogue (fusions/gelu.py, on CUDA) and FLUX.1's and
        Chroma's single-stream blocks project their attention and MLP outputs without joining them
        (patches/image/flux_mlp.py). Like fuse_rope, it changes rounding slightly; False keeps diffusers' layer code.
    check_inputs: the ranks check, in small collectives, that they got the same arguments and models (weights
        included) at `enable`, and the same arguments at every pipeline call.
    cuda_graphs: each transformer's forward is captured per input signature in a CUDA graph and replayed; None: on
        where there is a GPU.
    parallel_vae: the VAE decode is split by rows across all the job's ranks; None: where the pipeline's VAE is
        supported.
    expert_parallel: mixture-of-experts layers keep E/N experts per rank of the Ulysses group (True), every
        expert on every rank (False), or every expert with the mode picked per call by the planner (None).
    fp8: what runs in FP8 (e4m3 with float32 scales): any of "attention" (the attention kernel's two products:
        q·kᵀ in INT8 of smoothed keys, p·v in e4m3; the backend keeps its exchange), "linear" (the projections of
        the transformer's blocks, as torchao's FP8 GEMMs; layers the model keeps in float32, diffusers'
        layerwise-casting skip list and the layers outside the blocks stay out) and "payloads" (the fused backend's
        Ulysses payloads, quantized where they are stored and dequantized where they are read), or "all"; None
        (default) or () runs everything in the model's dtype. Stored as a tuple in FP8_PARTS' order.
    fp8_full_precision_steps: the first and last this many denoising steps of a pipeline call run without FP8
        (the steps that set the layout and the fine detail are the ones most sensitive to rounding).
    """

    ulysses_degree: int | None = None
    ring_degree: int | None = None
    cfg_degree: int = 1
    backend: str = "auto"
    timeout_s: float = 600.0
    fuse_rope: bool = True
    fuse_mlp: bool = True
    check_inputs: bool = True
    cuda_graphs: bool | None = None
    parallel_vae: bool | None = None
    expert_parallel: bool | None = None
    fp8: tuple[str, ...] | str | None = None
    fp8_full_precision_steps: int = 0

    def __post_init__(self) -> None:
        # a value of the wrong type raises TypeError, one of the right type out of range ValueError
        for name in ("ulysses_degree", "ring_degree"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise TypeError(f"{name} must be None or an int >= 1, got {value!r}")
            if value is not None and value < 1:
                raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")
        if not _is_int(self.cfg_degree):
            raise TypeError(f"cfg_degree must be 1 or 2 (guidance has two branches), got {self.cfg_degree!r}")
        if self.cfg_degree not in (1, 2):
            raise ValueError(f"cfg_degree must be 1 or 2 (guidance has two branches), got {self.cfg_degree!r}")
        if not isinstance(self.backend, str):
            raise TypeError(f"backend must be the name of a backend (one of xstage_dit.available_backends()), "
                            f"got {self.backend!r}")
        timeout = self.timeout_s
        if not isinstance(timeout, numbers.Real) or isinstance(timeout, bool):
            raise TypeError(f"timeout_s must be a positive number of seconds, got {timeout!r}")
        if not 0 < timeout < math.inf:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout!r}")
        for name in ("fuse_rope", "fuse_mlp", "check_inputs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name, default in (("cuda_graphs", "on where there is a GPU"), ("parallel_vae", "on where supported"),
                              ("expert_parallel", "chosen per layer call")):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{name} must be None ({default}), True or False, got {value!r}")
        object.__setattr__(self, "fp8", fp8_parts(self.fp8))
        steps = self.fp8_full_precision_steps
        if not _is_int(steps):
            raise TypeError(f"fp8_full_precision_steps must be an int >= 0, got {steps!r}")
        if steps < 0:
            raise ValueError(f"fp8_full_precision_steps must be an int >= 0, got {steps!r}")

    def sequence_ranks(self, world_size: int) -> int:
        """The ranks that split one sequence in a job of `world_size` ranks (world_size / cfg_degree), with the
        degrees given checked against it: a ValueError names the one that does not fit. Needs only the launcher's
        world size, so a command line is checked before anything loads."""
        if world_size % self.cfg_degree:
            raise ValueError(f"cfg_degree={self.cfg_degree} does not divide the world size {world_size}")
        ranks = world_size // self.cfg_degree
        ulysses, ring = self.ulysses_degree, self.ring_degree
        with_cfg = f" with cfg_degree={self.cfg_degree}" if self.cfg_degree != 1 else ""
        for name, degree in (("ulysses_degree", ulysses), ("ring_degree", ring)):
            if degree is not None and ranks % degree:
                raise ValueError(f"{name}={degree} does not fit the world size {world_size}{with_cfg}: the ranks "
                                 f"are split into cfg_degree x ring_degree x ulysses_degree, so it must divide "
                                 f"{ranks}")
        if ulysses is not None and ring is not None and ulysses * ring != ranks:
            raise ValueError(f"ulysses_degree={ulysses} x ring_degree={ring} does not fit the world size "
                             f"{world_size}{with_cfg}: their product must be {ranks}")
        return ranks

    @classmethod
    def knobs(cls) -> tuple[str, ...]:
        """The names `enable` takes as keywords."""
        return tuple(field.name for field in fields(cls))

    def as_dict(self) -> dict[str, Any]:
        """Every knob by name: what the ranks compare at `enable`, so that a new knob cannot be left out."""
        return {name: getattr(self, name) for name in self.knobs()}
