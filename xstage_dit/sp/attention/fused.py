"""The fused Ulysses backend (X-Stage piggyback): no collective calls, only stores into a fabric's buffers
(sp/fabric.py) issued from the kernels themselves.

1. pre-all-to-all: one store kernel per q, k, v writes this rank's image tokens of every head chunk straight into
   the owning rank's head-sharded buffer, and its own chunk of the replicated text into its own; a caller that
   holds q and k as parts still to be normalised, joined and rotated (JointTokens) hands them over as they are,
   and the store kernel does that on the way (`fused_joint_ulysses`);
2. barrier: every rank's rows have landed;
3. attention with the scatter epilogue: each output tile's owner stores it into the buffer of the rank that owns
   those tokens, in that rank's (B, T + L, H, D) layout, and moves on to its next tile; the tile order is the
   Burst-Gap planner's (rotated unless it predicts rank-major faster);
4. barrier: every rank's output rows have landed; the output buffer is returned (the custom op in sp/attention/ops.py
   copies it out).

With FP8 payloads (XStageConfig.fp8 "payloads") the stores of steps 1 and 3 quantize each row in registers and
send e4m3 values with a float32 scale per row (kernels/fp8.py) into e4m3 buffers and scale buffers: half the
bytes on the wire. The receiver dequantizes the gathered q, k, v in one pass before its attention (the attention
kernels load their tiles with TMA into the tensor cores' bf16 operands: dequantizing inside them would cost the
Hopper kernel its load pipeline) and its output rows after the last barrier, into a tensor of its own.

`fused_steps` is that algorithm, paused before each barrier; `fused_exchange` runs one rank of it over a fabric.
Over the group's symmetric memory that is the backend; over a loopback fabric, tests and benchmarks run the same
steps for N simulated ranks (fabric.run_in_lockstep). The output buffer is a view kept past the call: valid until
this rank's next call on the fabric, which cannot start overwriting it before this rank has passed that call's
first barrier, i.e. after the caller consumed it (stream order)."""
from __future__ import annotations

from functools import lru_cache, partial

import torch
import torch.distributed as dist

from ...kernels.all_to_all import store_heads
from ...kernels.attention import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, flash_attention
from ...kernels.attention_args import PayloadScales
from ...kernels.attention_hopper import HopperConfig
from ...kernels.fp8 import PAYLOAD_DTYPE, SCALE_DTYPE, dequantize
from ...kernels.rotary_args import JointTokens
from ...burst_gap.planner import Planner
from ...burst_gap.ulysses_plan import AttentionShape, TileOrder, UlyssesPlanner
from .backends import LocalAttention, RingBlocks, Strategy, Supports
from ..fabric import Fabric, FabricBuffer, Steps, View, fabric_of, run_in_lockstep
from .layout import UlyssesLayout
from .local import flash_attention_bshd
from .masks import keep_keys
from ..planner import attention_shape, planner_for

# the query rows of the GPU kernels' output tiles (HopperConfig's; TileConfig's default is as tall): the store
# bursts the planner models
TILE_ROWS = HopperConfig().block_m


@lru_cache(maxsize=256)
def tile_order(planner: Planner | None, shape: AttentionShape) -> TileOrder:
    """Rotated unless the planner predicts rank-major faster (without a calibration: rotated, which the model
    never predicts slower)."""
    return TileOrder.ROTATED if planner is None else planner.ulysses.tile_order(shape, TILE_ROWS)


def _views(name: str, shape: tuple[int, ...], dtype: torch.dtype, payload: bool, kept: bool = False) -> list[View]:
    """A buffer of `dtype` values; with `payload`, an e4m3 payload and its rows' scales (`name`_scales)."""
    if not payload:
        return [View(name, shape, dtype, kept)]
    return [View(name, shape, PAYLOAD_DTYPE, kept), View(f"{name}_scales", shape[:-1], SCALE_DTYPE, kept)]


def _scales(buffers: dict[str, FabricBuffer], name: str) -> PayloadScales | None:
    """Where the stores into buffer `name` put their row scales (None: it holds values, not a payload)."""
    scales = buffers.get(f"{name}_scales")
    return None if scales is None else PayloadScales.of(scales.tensor, scales.destinations)


def _values(buffers: dict[str, FabricBuffer], name: str, dtype: torch.dtype) -> torch.Tensor:
    """Buffer `name` as `dtype` values: itself, or its payload dequantized into a tensor of its own."""
    scales = buffers.get(f"{name}_scales")
    return buffers[name].tensor if scales is None else dequantize(buffers[name].tensor, scales.tensor, dtype)


def fused_steps(query: JointTokens, key: JointTokens, value: JointTokens, layout: UlyssesLayout,
                fabric: Fabric, scale: float | None, text_mask: torch.Tensor | None,
                order: TileOrder, fp8: bool = False, fp8_payloads: bool = False) -> Steps[torch.Tensor]:
    """One rank's fused Ulysses attention over `fabric`, yielding before each barrier what it waits for; `fp8`: it
    attends with FP8 attention; `fp8_payloads`: its payloads travel in FP8 (the module docstring)."""
    batch, query_rows, heads, head_dim = query.joined_shape
    dtype = query.parts[0].dtype
    share = heads // layout.degree
    # per tensor: (its text rows, its rows once gathered)
    rows = {"q": (layout.query_text_len, layout.query_gathered_len), "k": (layout.text_len, layout.gathered_len),
            "v": (layout.text_len, layout.gathered_len)}
    # the output is kept past the call (the caller reads it after the last barrier)
    buffers = fabric.carve([*(view for name, (_, gathered) in rows.items()
                              for view in _views(name, (batch, gathered, share, head_dim), dtype, fp8_payloads)),
                            *_views("out", (batch, query_rows, heads, head_dim), dtype, fp8_payloads, kept=True)])
    for name, tokens in zip(rows, (query, key, value)):
        store_heads(tokens, layout.store_rows(rows[name][0]), offsets=buffers[name].destinations,
                    base=buffers[name].tensor, rank=layout.rank, scales=_scales(buffers, name))
    out = buffers["out"]
    yield "fused attention (pre-all-to-all)"
    q, k, v = (_values(buffers, name, dtype) for name in rows)
    scatter = layout.output_scatter(out.tensor, out.destinations, share, order, _scales(buffers, "out"))
    flash_attention(q, k, v, scale=scale, kv_len=layout.key_len, key_mask=keep_keys(text_mask), epilogue=scatter,
                    fp8=fp8)
    yield "fused attention (post-all-to-all)"
    return _values(buffers, "out", dtype)


def fused_exchange(query: JointTokens, key: JointTokens, value: JointTokens, layout: UlyssesLayout,
                   fabric: Fabric, scale: float | None, text_mask: torch.Tensor | None,
                   order: TileOrder, fp8: bool = False, fp8_payloads: bool = False) -> torch.Tensor:
    """One rank's fused Ulysses attention over `fabric` (FP8 attention: `fp8`); returns the fabric's output buffer
    (with `fp8_payloads`, its payload dequantized into a tensor of its own)."""
    (out,) = run_in_lockstep([fused_steps(query, key, value, layout, fabric, scale, text_mask, order, fp8,
                                          fp8_payloads)], fabric.barrier)
    return out


def predicted_seconds(planner: UlyssesPlanner, shape: AttentionShape) -> float:
    return planner.fused_call(shape, TILE_ROWS)


def describe_tile_order(planner: Planner, shape: AttentionShape) -> str:
    return f"the fused kernel's tile order: {tile_order(planner, shape).value}"


def fused_joint_ulysses(query: JointTokens, key: JointTokens, value: JointTokens, layout: UlyssesLayout,
                        group: dist.ProcessGroup, scale: float | None, text_mask: torch.Tensor | None,
                        fp8: bool = False, fp8_payloads: bool = False) -> torch.Tensor:
    """The fused backend for q, k, v held as parts (their norm and rotation, where asked, in the stores); `fp8`:
    FP8 attention, `fp8_payloads`: FP8 payloads."""
    first = query.parts[0]
    order = tile_order(planner_for(first.device, layout.degree), attention_shape(first, layout, fp8_payloads))
    return fused_exchange(query, key, value, layout, fabric_of(group.group_name), scale, text_mask, order, fp8,
                          fp8_payloads)


def fused_ulysses(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: UlyssesLayout,
    group: dist.ProcessGroup,
    scale: float | None,
    text_mask: torch.Tensor | None,
    attend: LocalAttention | None = None,  # unused: the fused backend attends with its own kernel
    fp8: bool = False,
) -> torch.Tensor:
    return fused_joint_ulysses(JointTokens((query,)), JointTokens((key,)), JointTokens((value,)), layout, group,
                               scale, text_mask, fp8)


CHOICE = Strategy(
    "fused", ulysses=fused_ulysses, local=flash_attention_bshd, cost=predicted_seconds, ring=RingBlocks.STORED,
    supports=Supports(
        dtypes=SUPPORTED_DTYPES, head_dims=SUPPORTED_HEAD_DIMS, cuda_only=True,
        exchange_refused="its attention kernel stores each output tile into the rank that owns those tokens, so no "
                         "other attention can run between its exchanges"),
    symmetric=True, own_attention=True, joint=fused_joint_ulysses,
    fp8_payloads=partial(fused_joint_ulysses, fp8_payloads=True), describe_plan=describe_tile_order,
).with_fp8(ulysses=partial(fused_ulysses, fp8=True), joint=partial(fused_joint_ulysses, fp8=True),
           fp8_payloads=partial(fused_joint_ulysses, fp8=True, fp8_payloads=True))
