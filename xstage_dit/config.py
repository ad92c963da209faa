"""The one dataclass of user-facing knobs."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class XStageConfig:
    """What `xstage_dit.enable` was asked for, after defaults are resolved.

    ulysses_degree: ranks that split one sequence (Ulysses sequence parallelism).
    cfg_degree: groups of ranks that split the classifier-free-guidance branches.
    backend: how Ulysses moves data; see `xstage_dit.sp.attention.backends.available_backends()`.
    timeout_s: bound on every cross-rank wait; a wait past it raises instead of hanging.
    fuse_rope: the patched attention's diffusers `apply_rotary_emb` calls run our one-pass RoPE kernel (GPU); in
        Flux and Chroma the q/k RMSNorms before it run in the same pass (patches/flux.py NormRopeProcessor).
    fuse_mlp: the feed-forwards' tanh-GELU runs in its GEMM's epilogue (fusions/gelu.py, on CUDA) and FLUX.1's and
        Chroma's single-stream blocks project their attention and MLP outputs without joining them
        (patches/flux_mlp.py).
        Like fuse_rope, it changes rounding slightly; False keeps diffusers' layer code.
    check_inputs: the ranks check, in one small collective at `enable`, that they got the same arguments and
        models (weights included).
    cuda_graphs: each transformer's forward is captured per input signature in a CUDA graph and replayed.
    parallel_vae: the VAE decode is split by rows across all the job's ranks.
    expert_parallel: mixture-of-experts layers keep E/N experts per rank of the Ulysses group (True), every
        expert on every rank (False), or every expert with the mode picked per call by the planner (None).
    """

    ulysses_degree: int
    cfg_degree: int = 1
    backend: str = "auto"
    timeout_s: float = 600.0
    fuse_rope: bool = True
    fuse_mlp: bool = True
    check_inputs: bool = True
    cuda_graphs: bool = False
    parallel_vae: bool = False
    expert_parallel: bool | None = None
