"""FP8 attention (kernels/attention.py with fp8=True: INT8 q·kᵀ of smoothed keys, e4m3 p·v, float32 scales, sums
and log-sum-exp) against float64 references on fresh random inputs, its error bounded per shape with bf16's error on
the same inputs as the yardstick; its quantization pass (kernels/attention_fp8.py) against torch's own arithmetic;
the registry's FP8 variants and the knob that selects them, through the router, the op and the ring.

On CPU the kernels run in Triton's interpreter (float32 inputs, small shapes; the yardstick is the error of the
inputs rounded to bf16); on a GPU (marked) in bf16 at real sizes, the yardstick our bf16 kernel's error, and also
captured in a CUDA graph and under torch.compile. The epilogues' FP8 runs share the bf16 tests' harnesses:
test_kernels.py (key forward, merge, the fused loopback's scatter) and test_ring_stores.py (the X-Stage ring)."""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_on_ranks
from gpu_checks import same_gpu_worker
from numerics import (FP8_ATTENTION_ERROR, FP8_LSE_ERROR, FP8_OVER_BF16, FP8_OVER_BF16_KERNEL, attention_reference,
                      relative_error)

pytest.importorskip("triton", reason="triton is not installed: the fused extra (CUDA builds of torch bring it)")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from xstage_dit.kernels.attention import FP8_CONFIG, TileConfig, flash_attention  # noqa: E402
from xstage_dit.kernels.attention_args import Store, ValueOrder  # noqa: E402
from xstage_dit.kernels.attention_fp8 import (OPERAND_KEY_ORDER, OPERAND_KEY_SLICE, offset_scores,  # noqa: E402
                                             quantize, softmax_weights, to_operand_order)
from xstage_dit.kernels.fp8 import to_e4m3  # noqa: E402
from xstage_dit.sp.attention.backends import (Precision, available_backends, backends, get_choice,  # noqa: E402
                                              resolve_backend)

# (batch, query rows, key rows, keys attended, heads, key heads, head_dim, key mask, the keys' and the values'
# shared component): uneven lengths everywhere, and the bound on the output's relative error for each
SHAPES = {
    "d64": ((2, 37, 45, 41, 4, 4, 64, False, 0.0, 0.0), FP8_ATTENTION_ERROR),
    "d128": ((2, 37, 45, 41, 4, 4, 128, False, 0.0, 0.0), FP8_ATTENTION_ERROR),
    "grouped-keys": ((2, 37, 45, 41, 4, 1, 128, False, 0.0, 0.0), FP8_ATTENTION_ERROR),
    "key-mask": ((2, 37, 45, 41, 4, 2, 64, True, 0.0, 0.0), FP8_ATTENTION_ERROR),
    # a component every key shares (as DiT keys have): the smoothing keeps it out of the INT8 range
    "shared-key-component": ((2, 37, 45, 41, 4, 2, 128, False, 4.0, 0.0), FP8_ATTENTION_ERROR),
    # likewise for the values: the output is mostly their mean, which comes back exactly
    "shared-value-component": ((2, 37, 45, 41, 4, 2, 64, False, 0.0, 3.0), FP8_ATTENTION_ERROR / 5),
    # one key (a ring's last block can hold one): smoothed to zeros, its score and value come back whole
    "one-key": ((2, 37, 45, 1, 4, 2, 64, False, 0.0, 0.0), 1e-5),
}
GPU_SHAPES = {
    "d64": ((2, 1000, 1100, 1031, 3, 3, 64, False, 0.0, 0.0), FP8_ATTENTION_ERROR),
    "d128": ((2, 1000, 1100, 1031, 3, 3, 128, False, 0.0, 0.0), FP8_ATTENTION_ERROR),
    "flux-one-rank": ((1, 4608, 4608, 4608, 3, 3, 128, False, 0.0, 0.0), FP8_ATTENTION_ERROR),
    "grouped-keys": ((2, 1000, 4000, 3999, 6, 2, 128, False, 0.0, 0.0), FP8_ATTENTION_ERROR),
    "key-mask": ((2, 1000, 1100, 1031, 3, 3, 128, True, 0.0, 0.0), FP8_ATTENTION_ERROR),
    "shared-key-component": ((1, 2048, 2048, 2048, 3, 3, 128, False, 4.0, 0.0), FP8_ATTENTION_ERROR),
}


def _inputs(device: str, shape: tuple, dtype: torch.dtype) -> tuple:
    batch, q_len, kv_rows, _, heads, kv_heads, head_dim, masked, key_shift, value_shift = shape
    q = torch.randn(batch, q_len, heads, head_dim, device=device)
    k = torch.randn(batch, kv_rows, kv_heads, head_dim, device=device)
    v = torch.randn(batch, kv_rows, kv_heads, head_dim, device=device)
    k = k + key_shift * torch.randn(1, 1, kv_heads, head_dim, device=device)
    v = v + value_shift * torch.randn(1, 1, kv_heads, head_dim, device=device)
    key_mask = (torch.rand(batch, 9, device=device) > 0.4) if masked else None
    return q.to(dtype), k.to(dtype), v.to(dtype), key_mask


def _check_bounded(device: str, dtype: torch.dtype, shape: tuple, bound: float,
                   config: TileConfig | None = None) -> None:
    """FP8 attention's output and log-sum-exp against float64: within `bound` and FP8_LSE_ERROR, and within
    FP8_OVER_BF16 (FP8_OVER_BF16_KERNEL in bf16) times the yardstick (float32: the error of the inputs rounded to
    bf16; bf16: our bf16 kernel's). `config`: the kernel's (None: the default for the device)."""
    kv_len = shape[3]
    q, k, v, key_mask = _inputs(device, shape, dtype)
    out = torch.full_like(q, float("nan"))
    attended = flash_attention(q, k, v, kv_len=kv_len, key_mask=key_mask, epilogue=Store(out, lse=True), fp8=True,
                               config=config)
    out, lse = attended.out, attended.lse
    ref, ref_lse = attention_reference(q, k, v, kv_len, key_mask)
    bf16 = [t.bfloat16().to(dtype) for t in (q, k, v)]
    yardstick = relative_error(flash_attention(*bf16, kv_len=kv_len, key_mask=key_mask).out, ref)
    error = relative_error(out, ref)
    assert not out.isnan().any(), "unwritten output"
    assert error < bound, f"FP8 attention's relative error {error:.2e} (bf16's {yardstick:.2e})"
    over = FP8_OVER_BF16 if dtype == torch.float32 else FP8_OVER_BF16_KERNEL
    assert error < over * yardstick, f"FP8 attention's relative error {error:.2e}, bf16's {yardstick:.2e}"
    assert (lse.double() - ref_lse).abs().max().item() < FP8_LSE_ERROR


@pytest.mark.parametrize("shape, bound", SHAPES.values(), ids=SHAPES.keys())
def test_fp8_attention_is_bounded_per_shape_interpreted(shape, bound):
    _check_bounded("cpu", torch.float32, shape, bound)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [pytest.param("default", marks=pytest.mark.smoke), "triton"])
@pytest.mark.parametrize("shape, bound", GPU_SHAPES.values(), ids=GPU_SHAPES.keys())
def test_fp8_attention_is_bounded_per_shape_on_gpu(shape, bound, kernel):
    """Both FP8 kernels: the default (on Hopper the Gluon kernel, whose persistent launch splits the tail of
    flux-one-rank's 108 tiles over their keys) and the portable Triton kernel."""
    _check_bounded("cuda", torch.bfloat16, shape, bound, FP8_CONFIG if kernel == "triton" else None)


def test_the_hopper_kernel_refuses_to_forward_fp8_keys_in_words():
    """The Gluon kernel's FP8 ring would read 8-bit tiles: a call that forwards its keys is refused there (by
    default such calls run the Triton kernel, which forwards the keys as given)."""
    from xstage_dit.kernels import attention_hopper as hopper
    from xstage_dit.kernels.attention_args import AttentionCall, KeyForward

    q = torch.randn(1, 16, 2, 64)
    operands = quantize(q, q, q, 16, 16, 16)
    epilogue = Store()
    call = AttentionCall(q, q, q, 0.125, 16, None, epilogue, epilogue.result_for(q),
                         KeyForward(q.data_ptr(), q.data_ptr()))
    with pytest.raises(ValueError, match="the Hopper kernel's FP8 attention forwards no keys"):
        hopper.launch(call, hopper.HopperConfig(), hopper.TmaRows.TOKENS, fp8=operands)


def _operand_key_order(keys: int) -> torch.Tensor:
    """The key each position of the values holds in the Hopper kernel's operand order, for whole 32-key slices:
    what the kernel's relabelling of a score tile's columns makes of their indices."""
    slices = torch.arange(keys).reshape(-1, *OPERAND_KEY_SLICE)
    return slices.permute(0, *(d + 1 for d in OPERAND_KEY_ORDER)).reshape(keys)


@pytest.mark.parametrize("operand_order, block", [(False, 16), (True, 32)])
def test_quantized_operands_invert_to_the_inputs_interpreted(operand_order: bool, block: int):
    """q and the smoothed k come back from their INT8 values and tile scales within half a step, each tile's
    largest |x| on 127; v's e4m3 values are torch's conversion of (v - mean) / scale, value for value, in key order
    or in the Hopper kernel's operand order, its padding keys zeros; each query's shift is its dot product with its
    key head's mean key; rows past the keys attended are not read."""
    batch, q_len, kv_rows, kv_len, heads, kv_heads, head_dim = 2, 37, 45, 41, 4, 2, 64
    q = torch.randn(batch, q_len, heads, head_dim)
    k = torch.randn(batch, kv_rows, kv_heads, head_dim) + 3
    v = torch.randn(batch, kv_rows, kv_heads, head_dim) - 2
    k[:, kv_len:], v[:, kv_len:] = float("nan"), float("nan")
    ops = quantize(q, k, v, kv_len, block, block, operand_order=operand_order)
    assert ops.v_order is (ValueOrder.OPERAND if operand_order else ValueOrder.KEYS)
    keys, values = k[:, :kv_len], v[:, :kv_len]
    k_mean, v_mean = keys.mean(1), values.mean(1)
    for x8, scale, x in ((ops.q, ops.q_scale, q), (ops.k, ops.k_scale, keys - k_mean[:, None])):
        rows = x.shape[1]
        step = scale.repeat_interleave(block, -1)[..., :rows].transpose(1, 2)[..., None]  # each row's tile's
        assert ((x8.float() * step - x).abs() <= step / 2 * (1 + 1e-5)).all()
        padded = torch.zeros(batch, heads if x is q else kv_heads, scale.shape[-1] * block, head_dim)
        padded[:, :, :rows] = x8.abs().float().transpose(1, 2)
        assert (padded.flatten(-2).unflatten(-1, (-1, block * head_dim)).amax(-1) == 127).all()
    torch.testing.assert_close(ops.v_mean, v_mean)
    expected_v = torch.zeros(batch, ops.v.shape[-1], kv_heads, head_dim)
    expected_v[:, :kv_len] = ((values - v_mean[:, None]) / ops.v_scale[:, None]).to(torch.float8_e4m3fn).float()
    if operand_order:
        expected_v = expected_v[:, _operand_key_order(expected_v.shape[1])]
    assert torch.equal(ops.v.permute(0, 3, 1, 2).float(), expected_v)  # -0 == 0
    shift = torch.einsum("bqhd,bhd->bhq", q, k_mean.repeat_interleave(heads // kv_heads, 1))
    torch.testing.assert_close(ops.q_shift, shift, rtol=1e-5, atol=1e-5)


@triton.jit
def _relabel_kernel(X, Out, ROWS: tl.constexpr, KEYS: tl.constexpr):
    at = tl.arange(0, ROWS)[:, None] * KEYS + tl.arange(0, KEYS)[None, :]
    tl.store(Out + at, to_operand_order(tl.load(X + at)))


def test_the_operand_order_pairs_each_weight_with_its_value_interpreted():
    """The Hopper kernel's FP8 p·v takes its weights relabelled by attention_fp8.to_operand_order (run here as
    it is); the values quantized in the operand order hold the same keys in the same order, so the product equals
    the one in key order."""
    keys, head_dim = 128, 64
    q, v = torch.randn(1, 16, 1, head_dim), torch.randn(1, keys, 1, head_dim)
    natural = quantize(q, v, v, keys, 16, 32).v[0, 0].double().T
    ordered = quantize(q, v, v, keys, 16, 32, operand_order=True).v[0, 0].double().T
    p = torch.rand(16, keys)
    relabelled = torch.empty_like(p)
    _relabel_kernel[(1,)](p, relabelled, 16, keys)
    torch.testing.assert_close(relabelled.double() @ ordered, p.double() @ natural, rtol=1e-12, atol=1e-12)


def test_each_kernel_refuses_the_other_kernels_value_order():
    """The Hopper kernel reads values in its operand order only, the Triton kernel in key order only, and the
    operand order comes in whole 32-key tiles: each refused in words before any launch."""
    from xstage_dit.kernels import attention, attention_hopper as hopper
    from xstage_dit.kernels.attention_args import AttentionCall

    q = torch.randn(1, 64, 2, 64)
    epilogue = Store()
    call = AttentionCall(q, q, q, 0.125, 64, None, epilogue, epilogue.result_for(q), None)
    with pytest.raises(ValueError, match="reads values in its operand's key order"):
        hopper.launch(call, hopper.HopperConfig(), hopper.TmaRows.TOKENS, fp8=quantize(q, q, q, 64, 64, 64))
    with pytest.raises(ValueError, match="reads values in key order"):
        attention.launch_triton(call, FP8_CONFIG, use_tma=False,
                                fp8=quantize(q, q, q, 64, 64, 64, operand_order=True))
    with pytest.raises(ValueError, match="whole 32-key slices, got 16-key tiles"):
        quantize(q, q, q, 64, 16, 16, operand_order=True)


@triton.jit
def _softmax_kernel(S, M, P, Scale, ROWS: tl.constexpr, KEYS: tl.constexpr, SHIFT: tl.constexpr):
    rows = tl.arange(0, ROWS)
    at = rows[:, None] * KEYS + tl.arange(0, KEYS)[None, :]
    p, m, _ = softmax_weights(offset_scores(tl.load(S + at)), tl.load(M + rows), tl.load(Scale), SHIFT, True)
    tl.store(P + at, p)
    tl.store(M + rows, m)


@pytest.mark.parametrize("device, scale", [("cpu", 1e-4), ("cpu", 1e-3), *(
    pytest.param("cuda", scale, marks=pytest.mark.gpu) for scale in (1e-6, 1e-3, 0.1))])
def test_fp8_softmax_takes_the_score_offset_out_once_a_row(device: str, scale: float):
    """INT8 products' scores, offset by 1.5 * 2^23 into float32, and the online softmax's step over them, with the
    scale it uses (its last two mantissa bits dropped): the row maxima returned are those of the scores times that
    scale, within a float32 step of the offset times the scale (the maximum the exponents subtract, rounded with
    the offset in it); each weight is 2 to the power of its score times the scale less that row maximum (plus the
    shift), as float64 computes it from the maximum returned, so that the weights' sums and the maxima give the
    log-sum-exp exactly. A GPU fuses the exponent's multiply-add: within 2e-6 at any scale. Triton's interpreter
    rounds the product first, by up to half a float32 step of 1.5 * 2^23 * scale."""
    generator = torch.Generator().manual_seed(3)
    spread = min(2**20, int(20 / scale))  # INT8 products over 128 channels stay below 2^21
    scores = torch.randint(-spread, spread, (16, 64), generator=generator, dtype=torch.int32)
    scores[:, 1] = scores[:, 0] - 3  # close runners-up
    m_before = torch.full((16,), float("-inf"))
    m_before[8:] = scores[8:].amax(1).double() * scale + 1.5  # rows whose running maximum stays above the tile's
    shift = 8.8073549220576  # log2(448): the Hopper kernel's
    p, m = torch.empty(16, 64, device=device), m_before.clone().to(device)
    _softmax_kernel[(1,)](scores.to(device), m, p, torch.tensor([scale], device=device), 16, 64, shift)
    m, p = m.cpu().double(), p.cpu().double()
    used = (torch.tensor([scale]).view(torch.int32) & -4).view(torch.float32).double()
    maxima = torch.maximum(m_before.double(), scores.amax(1).double() * used)
    offset = 1.5 * 2**23 * used
    assert ((m - maxima).abs() <= 2**-23 * (offset + maxima.abs())).all()
    expected = torch.exp2(scores.double() * used - m[:, None] + shift)
    bound = 2e-6 if device == "cuda" else 2e-6 + 2**-24 * 1.5 * 2**23 * scale
    assert ((p - expected).abs() <= bound * expected + 1e-30).all(), ((p - expected).abs() / expected).max()


@triton.jit
def _convert_kernel(X, Out, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Out + offs, to_e4m3(tl.load(X + offs)))


def test_e4m3_conversion_rounds_as_torch_does_interpreted():
    """The interpreter's conversion with its values put on the e4m3 grid first (fp8.to_e4m3): every
    finite e4m3 value, every midpoint between two (ties to even) and random values over the whole range convert
    to what torch's float8_e4m3fn conversion gives."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].sort().values
    spread = torch.randn(4096) * 10 ** (torch.rand(4096) * 6.6 - 4)
    x = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, spread.clamp(-448, 448)])
    x = torch.cat([x, x.new_zeros(8192 - x.numel())])
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    _convert_kernel[(1,)](x, out, x.numel())
    assert torch.equal(out.float(), x.to(torch.float8_e4m3fn).float())


def test_each_strategy_has_an_fp8_variant_that_only_the_knob_reaches(monkeypatch):
    """Every strategy's FP8 variant is an entry of its own (the op finds it by name, auto picks among them), not a
    backend name: enable's fp8 knob resolves a choice to its variant. Where Triton does not run, the knob is
    refused, and a call that reaches a variant there runs the reference."""
    from xstage_dit.sp.attention import backends as registry

    natives = [strategy.name for strategy in backends()]
    assert [strategy.name for strategy in backends(Precision.FP8)] == [f"{name}+fp8" for name in natives]
    assert available_backends() == ["auto", "fused", "overlap", "reference"]
    for name in natives:
        variant = get_choice(f"{name}+fp8")
        assert variant.precision is Precision.FP8 and get_choice(name).fp8 is variant
        assert not variant.supports.pair_bias and variant.supports.head_dims == (64, 128)
        assert variant.ring is get_choice(name).ring and variant.cost is get_choice(name).cost
    cpu = torch.device("cpu")
    assert resolve_backend("reference", cpu, fp8=True).name == "reference+fp8"
    auto = resolve_backend("auto", cpu, fp8=True)
    assert auto.name == "auto+fp8" and {s.name for s in auto.candidates()} == {f"{n}+fp8" for n in natives}
    with pytest.raises(ValueError, match=r"unknown xstage_dit backend 'reference\+fp8'"):
        resolve_backend("reference+fp8", cpu)
    with pytest.raises(ValueError, match="needs CUDA GPUs"):
        resolve_backend("fused", cpu, fp8=True)
    monkeypatch.setattr(registry, "triton_runs_on", lambda device: False)
    with pytest.raises(ValueError, match=r"fp8=\"attention\" runs our Triton attention kernel"):
        resolve_backend("reference", cpu, fp8=True)
    assert get_choice("reference+fp8").pick(registry.Call(torch.randn(1, 8, 2, 64))).name == "reference"


def _router_worker(ulysses: int, ring: int) -> None:
    """Ulysses attention (the router, the custom op; around the ring by point-to-point sends) under the reference
    strategy's FP8 variant, with a padded prompt and uneven sequence splits: at ring degree 1 every rank attends
    its heads as one process's FP8 kernel does, in a ring each block is quantized on its own and the result stays
    within FP8 attention's bound; degree 1 runs the FP8 kernel too."""
    from xstage_dit.runtime.distributed import build_groups, ensure_process_group
    from xstage_dit.sp.attention.local import fp8_attention_bshd
    from xstage_dit.sp.attention.ops import local_attention
    from xstage_dit.sp.attention.ulysses import UlyssesAttention
    from xstage_dit.sp.sharding import SequenceShard

    ensure_process_group(60.0)
    groups = build_groups(1, ulysses, 60.0, ring)
    shard = SequenceShard(groups.sequence_degree, groups.sequence_rank, groups.sequence_group)
    attention = UlyssesAttention(shard, get_choice("reference+fp8"), ulysses=groups.ulysses, ring=groups.ring)
    torch.manual_seed(0)
    text, image, heads = 5, 23, 4
    q, k, v = (torch.randn(2, text + image, heads, 64) for _ in range(3))
    mask = torch.ones(2, 1, 1, text + image, dtype=torch.bool)
    mask[1, ..., 2:text] = False

    def mine(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[:, :text], shard.shard(t[:, text:], 1)], dim=1)

    out = attention(mine(q), mine(k), mine(v), attn_mask=mine(mask.transpose(1, 3)).transpose(1, 3))
    rows = text + max(0, min(shard.local_len, image - shard.rank * shard.local_len))
    if ring == 1:
        expected = mine(fp8_attention_bshd(q, k, v, mask, None))
        torch.testing.assert_close(out[:, :rows], expected[:, :rows], atol=1e-4, rtol=1e-4)
    else:
        reference, _ = attention_reference(q, k, v, text + image, mask[:, 0, 0, :text])
        assert relative_error(out[:, :rows], mine(reference)[:, :rows]) < FP8_ATTENTION_ERROR
    one = local_attention(q, k, v, mask, "reference+fp8", None)
    torch.testing.assert_close(one, fp8_attention_bshd(q, k, v, mask, None))


@pytest.mark.parametrize("ulysses, ring", [(2, 1), (2, 2)])
def test_the_fp8_variant_runs_through_the_router_the_op_and_the_ring(ulysses, ring):
    run_on_ranks(ulysses * ring, _router_worker, ulysses, ring, deadline_s=600)


def test_enable_runs_fp8_attention_where_asked_and_refuses_payloads_without_their_backend():
    """fp8="attention" makes every attention call of a head_dim-64 model run our FP8 kernel (its latents close to
    stock), but in the full-precision steps (fp8_full_precision_steps), which attend as without FP8; FP8 payloads
    with a backend that sends none are refused in words, before any collective."""
    import xstage_dit
    from xstage_dit.kernels import attention as kernel
    from xstage_dit.testing import zoo

    pipe = zoo.build_pipeline("tiny-flux-d64")

    def latents(steps: int = 2) -> torch.Tensor:
        kwargs = zoo.call_kwargs("tiny-flux-d64", height=20, width=28, num_frames=1, steps=steps, guidance=2.0)
        return pipe(**kwargs, **zoo.text_embeddings("tiny-flux-d64", 1, seed=0), output_type="latent",
                    generator=torch.Generator().manual_seed(0), return_dict=False)[0]

    stock = latents()
    with pytest.raises(ValueError, match=r"fp8=\"payloads\": backend 'reference' sends no FP8 payloads"):
        xstage_dit.enable(pipe, fp8=("attention", "payloads"), backend="reference")
    calls = []
    original = kernel.flash_attention
    kernel.flash_attention = lambda *args, **kwargs: calls.append(kwargs.get("fp8")) or original(*args, **kwargs)
    try:
        xstage_dit.enable(pipe, fp8="attention", backend="reference")
        error = relative_error(latents(), stock)
        assert calls and all(calls), calls
        per_step = len(calls) // 2
        xstage_dit.disable(pipe)
        calls.clear()
        # over 3 steps with the first and the last in full precision: the middle step's calls alone are FP8's
        xstage_dit.enable(pipe, fp8="attention", backend="reference", fp8_full_precision_steps=1)
        latents(steps=3)
        assert calls.count(True) == per_step, calls
    finally:
        xstage_dit.disable(pipe)
        kernel.flash_attention = original
    assert error < FP8_ATTENTION_ERROR, error


@pytest.mark.gpu
@pytest.mark.parametrize("backend, degrees", [pytest.param("fused", {}, marks=pytest.mark.smoke), ("reference", {}),
                                              ("auto", {}), ("fused", {"ulysses_degree": 2, "ring_degree": 2})],
                         ids=["fused", "reference", "auto", "fused-ring"])
def test_fp8_attention_on_ranks_of_one_gpu_matches_one_gpu(backend, degrees):
    """A tiny head_dim-64 FLUX.1 enabled with fp8="attention" on ranks sharing one GPU (the fused variant's scatter
    over symmetric memory, the reference variant's gathered heads, the stored ring's forward and merge) against
    the stock pipeline on one GPU, within the bf16 pipelines' tolerance."""
    ranks = 4 if degrees else 2
    run_on_ranks(ranks, same_gpu_worker, "tiny-flux-d64", backend, None, None, degrees, "attention", deadline_s=300)


@pytest.mark.gpu
@pytest.mark.smoke
def test_fp8_attention_replays_in_a_cuda_graph():
    """The quantization and the attention kernel captured once (their operands allocated inside the graph) and
    replayed on fresh inputs equal the eager call on those inputs bit for bit."""
    static = [torch.randn(1, 4608, 12, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    flash_attention(*static, fp8=True)  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attention(*static, fp8=True).out
    for _ in range(3):
        fresh = [torch.randn_like(t) for t in static]
        for slot, value in zip(static, fresh):
            slot.copy_(value)
        graph.replay()
        assert torch.equal(out, flash_attention(*fresh, fp8=True).out)


@pytest.mark.gpu
@pytest.mark.smoke
def test_fp8_attention_compiles_into_a_graph_as_the_op():
    """Degree-1 attention under the FP8 variant, in a function torch.compile compiles whole (fullgraph): the
    custom op keeps the kernels opaque, and the output equals the eager call's."""
    from xstage_dit.sp.attention.ops import local_attention

    q, k, v = (torch.randn(2, 1000, 6, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = torch.ones(2, 1, 1, 1000, dtype=torch.bool, device="cuda")
    mask[1, ..., 900:] = False

    def attend(q, k, v, mask):
        return local_attention(q * 2, k, v, mask, "fused+fp8", None) + 1

    compiled = torch.compile(attend, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, mask), attend(q, k, v, mask), atol=0, rtol=0)
