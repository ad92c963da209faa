"""Compile kernels/attention_hopper.py and kernels/rotary.py for sm_90a without a GPU
(test_kernels.test_hopper_kernel_compiles runs this in a subprocess): Triton is pointed at a stand-in driver that
reports an sm_90 target, and each kernel is compiled through ptxas by its own launcher; the attention kernel with
every switch on and off (head_dim, key mask + scatter, ping-pong; fp16, 64-key tiles and heads-major rows
once; grouped keys forwarded, with the LSE and with the merge into a running output: the X-Stage ring's
call; the scatter of an FP8 payload), the RoPE
kernel, the norm + RoPE kernel and the fused backend's store kernel (plain, and with the norm + RoPE; plain into an
FP8 payload) for bf16 at head_dim 128, whose PTX must have no fused multiply-add (they round as diffusers' code
does), the MoE expert kernel, whose matmuls must be Hopper's wgmma, and FP8 attention (the Triton attention kernel
and its quantization kernel, head_dim 64 and 128, with the key mask, LSE and scatter (of an FP8 payload once), and
the ring's forward and merge; the Gluon kernel the same, 64-key tiles at head_dim 64, merging without the forward),
whose products must be wgmma's INT8 and e4m3 ones.
Exits non-zero on the first failure."""
from __future__ import annotations

import itertools
import os
import tempfile
from pathlib import Path

import torch

from xstage_dit.testing.sm90_target import target_sm90


def main() -> None:
    target_sm90()
    from xstage_dit.kernels import attention_hopper as hopper
    from xstage_dit.kernels.attention_args import (AttentionCall, KeyForward, Merge, PayloadScales, Running, Scatter,
                                                   Store)
    from xstage_dit.kernels.fp8 import PAYLOAD_DTYPE

    batch, seq, heads = 2, 1000, 3

    def call(q, kv, epilogue, key_mask=None, forward=None) -> AttentionCall:
        return AttentionCall(q, kv, kv, 0.1, seq, key_mask, epilogue, epilogue.result_for(q), forward)

    for head_dim, (masked, scatter), pingpong in itertools.product(
            (64, 128), [(False, False), (True, True)], (False, True)):
        # fp16, 64-key tiles and heads-major rows once each, with the other switches on
        once = scatter and not pingpong
        dtype, block_n = (torch.float16, 64) if once else (torch.bfloat16, 128)
        view = hopper.TmaRows.HEADS if once else hopper.TmaRows.TOKENS
        config = hopper.HopperConfig(block_n=block_n, pingpong=pingpong)
        q = (torch.empty(batch, heads, seq, head_dim, dtype=dtype).transpose(1, 2) if view is hopper.TmaRows.HEADS
             else torch.empty(batch, seq, heads, head_dim, dtype=dtype))
        epilogue = (Scatter(q, torch.zeros(4, dtype=torch.int64), text_rows=7, rows_per_rank=250, text_row0=0,
                            image_row0=7, head0=0) if scatter else Store(q))
        hopper.launch(call(q, q, epilogue, torch.empty(batch, 8, dtype=torch.int8) if masked else None), config,
                      view, warmup=True)
        print("compiled", head_dim, dtype, masked, scatter, block_n, pingpong, view)
    # the X-Stage ring's call: LSE, grouped keys (3 query heads over 1 key head) forwarded to another buffer
    q = torch.empty(batch, seq, heads, 128, dtype=torch.bfloat16)
    kv = torch.empty(batch, seq, 1, 128, dtype=torch.bfloat16)
    to = torch.empty_like(kv)
    forward = KeyForward(to.data_ptr(), to.data_ptr())
    hopper.launch(call(q, kv, Store(q, lse=True), forward=forward), hopper.HopperConfig(), hopper.TmaRows.TOKENS,
                  warmup=True)
    print("compiled the key forward")
    # ... and the ring step that merges into a running float32 output
    running = Running(torch.empty(batch, seq, heads, 128), torch.empty(batch, heads, seq))
    hopper.launch(call(q, kv, Merge(running), forward=forward), hopper.HopperConfig(), hopper.TmaRows.TOKENS,
                  warmup=True)
    print("compiled the key forward with the merge")
    # the scatter of an FP8 payload: e4m3 rows, their scales stored alike
    payload = torch.empty(batch, seq, heads, 128, dtype=PAYLOAD_DTYPE)
    scales = PayloadScales.of(torch.empty(batch, seq, heads), torch.zeros(4, dtype=torch.int64))
    payload_scatter = Scatter(payload, torch.zeros(4, dtype=torch.int64), text_rows=7, rows_per_rank=250,
                              text_row0=0, image_row0=7, head0=0, scales=scales)
    hopper.launch(call(q, q, payload_scatter), hopper.HopperConfig(), hopper.TmaRows.TOKENS, warmup=True)
    print("compiled the scatter of an FP8 payload")

    from xstage_dit.kernels import rotary

    x = torch.empty(2, 100, 3, 128, dtype=torch.bfloat16)
    tables = torch.empty(100, 128)
    rotary.rotate(x, tables, tables, 1, warmup=True)
    (ptx,) = Path(os.environ["TRITON_CACHE_DIR"]).glob("*/_rotary_kernel.ptx")
    assert "fma.rn.f32" not in ptx.read_text(), "the RoPE kernel's PTX fuses a multiply-add"
    print("compiled rotary, no FMA")

    from xstage_dit.kernels.rotary_args import NormedTokens

    weight = torch.empty(128, dtype=torch.bfloat16)
    rotary.norm_rotate([NormedTokens(x[:, :20], weight, 1e-6), NormedTokens(x[:, 20:], weight, 1e-6)], tables,
                       tables, warmup=True)
    (ptx,) = Path(os.environ["TRITON_CACHE_DIR"]).glob("*/_norm_rope_kernel.ptx")
    assert "fma.rn.f32" not in ptx.read_text(), "the norm + RoPE kernel's PTX fuses a multiply-add"
    print("compiled norm + rope, no FMA")

    from xstage_dit.kernels.all_to_all import store_heads
    from xstage_dit.kernels.attention_args import StoreRows
    from xstage_dit.kernels.rotary_args import JointTokens, NormRope

    base = torch.empty(2, 150, 1, 128, dtype=torch.bfloat16)
    joint = JointTokens.normed_and_rotated([NormedTokens(x[:, :20], weight, 1e-6), NormedTokens(x[:, 20:], weight,
                                                                                                1e-6)], tables, tables)
    across = JointTokens((x,), NormRope((torch.empty(3 * 128, dtype=torch.bfloat16),), (1e-6,), tables, tables,
                                        across_heads=True))
    for tokens in (joint, JointTokens((x,)), across):
        store_heads(tokens, StoreRows(0, 20, 20), torch.zeros(3, dtype=torch.int64), base, rank=0, warmup=True)
    store_heads(JointTokens((x,)), StoreRows(0, 20, 20), torch.zeros(3, dtype=torch.int64),
                torch.empty(base.shape, dtype=PAYLOAD_DTYPE), rank=0,
                scales=PayloadScales.of(torch.empty(base.shape[:-1]), torch.zeros(3, dtype=torch.int64)), warmup=True)
    ptx = [path.read_text() for path in Path(os.environ["TRITON_CACHE_DIR"]).glob("*/_store_*_kernel.ptx")]
    assert len(ptx) == 4 and not any("fma.rn.f32" in text for text in ptx), "the store kernels' PTX fuses an FMA"
    print("compiled the store kernels, plain, with the norm + rope (per head, across heads) and into an FP8 "
          "payload, no FMA")

    from xstage_dit.kernels import experts

    rows, dim, width = 256, 2048, 1344  # NucleusMoE-Image's experts, two of them here
    x = torch.empty(2 * rows, dim, dtype=torch.bfloat16)
    gate_up = torch.empty(2, dim, 2 * width, dtype=torch.bfloat16)
    down = torch.empty(2, width, dim, dtype=torch.bfloat16)
    operands = experts.ExpertOperands(
        received=x, gate_up=gate_up, down=down, act=torch.empty(2 * rows, width, dtype=torch.bfloat16),
        combine=experts.Combine(buffer=torch.empty(4 * rows, dim, dtype=torch.bfloat16),
                                destinations=torch.zeros(2, dtype=torch.int64),
                                scale=torch.empty(2 * rows, dtype=torch.bfloat16),
                                owner=torch.zeros(2 * rows, dtype=torch.int32), slot0=0))
    experts.run_experts(operands, range(1, 2), range(0, 1), interleave=True, warmup=True)
    (ptx,) = Path(os.environ["TRITON_CACHE_DIR"]).glob("*/_experts_kernel.ptx")
    assert "wgmma" in ptx.read_text(), "the expert kernel's matmuls do not run on Hopper's tensor-core instructions"
    print("compiled the expert kernel (wgmma)")

    from xstage_dit.kernels import attention
    from xstage_dit.kernels.attention_fp8 import quantize

    config = attention.FP8_CONFIG
    for head_dim, ring in ((64, False), (128, False), (128, True)):
        q = torch.empty(batch, seq, heads, head_dim, dtype=torch.bfloat16)
        kv = torch.empty(batch, seq, 1, head_dim, dtype=torch.bfloat16)
        operands = quantize(q, kv, kv, seq, config.block_m, config.block_n, warmup=True)
        if ring:  # the X-Stage ring's step: grouped keys forwarded, merged into a running float32 output
            running = Running(torch.empty(batch, seq, heads, head_dim), torch.empty(batch, heads, seq))
            fp8_call = call(q, kv, Merge(running), forward=KeyForward(kv.data_ptr(), kv.data_ptr()))
        else:  # at head_dim 128, scattering an FP8 payload
            payload = head_dim == 128
            out = torch.empty(q.shape, dtype=PAYLOAD_DTYPE) if payload else q
            scales = PayloadScales.of(torch.empty(q.shape[:-1]), torch.zeros(4, dtype=torch.int64)) if payload \
                else None
            fp8_call = call(q, kv, Scatter(out, torch.zeros(4, dtype=torch.int64), text_rows=7, rows_per_rank=250,
                                           text_row0=0, image_row0=7, head0=0, scales=scales),
                            key_mask=torch.empty(batch, 8, dtype=torch.int8))
        attention.launch_triton(fp8_call, config, use_tma=False, fp8=operands, warmup=True)
        if ring:  # the Hopper kernel forwards no keys: the ring's step merges without forwarding
            fp8_call = call(q, kv, Merge(running))
        hopper_config = hopper.HopperConfig(block_n=64 if head_dim == 64 else 128)
        hopper_operands = quantize(q, kv, kv, seq, hopper_config.block_m, hopper_config.block_n, operand_order=True,
                                   warmup=True)
        hopper.launch(fp8_call, hopper_config, hopper.TmaRows.HEADS, warmup=True, fp8=hopper_operands)
    # the kernels share the name, and an FP8 payload's scatter converts to e4m3 too: FP8 attention's are the PTX
    # with INT8 products in it, three of each kernel
    ptx = [path.read_text() for path in Path(os.environ["TRITON_CACHE_DIR"]).glob("*/_attention_kernel.ptx")]
    fp8 = [text for text in ptx if "wgmma.mma_async.sync.aligned.m64n" in text and ".s32.s8.s8" in text]
    assert len(fp8) == 6 and all(".f32.e4m3.e4m3" in text for text in fp8), \
        "FP8 attention's products do not run on Hopper's INT8 and e4m3 wgmma"
    print("compiled FP8 attention, Triton and Hopper kernels (wgmma INT8 q·kᵀ, e4m3 p·v)")


if __name__ == "__main__":
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # a fresh cache: this run's PTX only
    main()
