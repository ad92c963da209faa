"""The grouped, sync-free MoE equals diffusers' HiDream `moe_infer` (which loops over experts sized on the host);
the X-Stage expert-parallel steps over a loopback fabric equal NucleusMoE's layer in one process."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU
from diffusers.models.transformers.transformer_nucleusmoe_image import NucleusMoELayer

from xstage_dit.sp.moe.choice import select
from xstage_dit.sp.moe.grouped import add_contributions
from xstage_dit.sp.moe.layer import ExpertChoiceCall, run_expert_choice
from xstage_dit.sp.moe.modes import ExpertModes
from xstage_dit.sp.moe.exchange import expert_steps, route_slots
from xstage_dit.sp.moe.token_choice import GroupedSwiGLUExperts, dispatch
from xstage_dit.sp.fabric import LoopbackFabric, gather_steps, run_in_lockstep
from xstage_dit.sp.sharding import SequenceShard
from xstage_dit.burst_gap.moe_plan import ExpertSchedule
from xstage_dit.sizes import ceil_div


def _layer(device: str = "cpu", dtype: torch.dtype = torch.float32, experts: int = 5) -> MOEFeedForwardSwiGLU:
    torch.manual_seed(0)
    return MOEFeedForwardSwiGLU(dim=64, hidden_dim=96, num_routed_experts=experts, num_activated_experts=2).to(
        device=device, dtype=dtype).eval()


def _grouped(layer: MOEFeedForwardSwiGLU, x: torch.Tensor) -> torch.Tensor:
    experts = GroupedSwiGLUExperts(layer.experts)
    index, weight, _ = layer.gate(x)
    flat = x.view(-1, x.shape[-1])
    routed = dispatch(index.view(-1), weight.view(-1), layer.num_activated_experts, experts.num_experts)
    return experts(flat, routed).view_as(x) + layer.shared_experts(x)


@pytest.mark.parametrize("tokens", [1, 37, 300])
def test_grouped_moe_matches_diffusers(tokens):
    layer = _layer()
    x = torch.randn(2, tokens, 64)
    with torch.no_grad():
        ref = layer(x)
        out = _grouped(layer, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_experts_left_unused_are_fine():
    layer = _layer()
    x = torch.randn(1, 8, 64)
    with torch.no_grad():
        layer.gate.weight.data[3:] = -10.0  # steer every token away from experts 3 and 4
        torch.testing.assert_close(_grouped(layer, x), layer(x), rtol=1e-5, atol=1e-5)


def _grouped_twice_and_diffusers(layer: MOEFeedForwardSwiGLU, x: torch.Tensor) -> list[torch.Tensor]:
    """The routed experts' sum for (tokens, C) inputs: ours twice, then diffusers' moe_infer's."""
    experts = GroupedSwiGLUExperts(layer.experts)
    with torch.no_grad():
        index, weight, _ = layer.gate(x.unsqueeze(0))
        routed = dispatch(index.view(-1), weight.view(-1), layer.num_activated_experts, experts.num_experts)
        ours = [experts(x, routed) for _ in range(2)]
        return ours + [MOEFeedForwardSwiGLU.moe_infer(layer, x, index.view(-1), weight.view(-1, 1))]


def test_grouped_moe_sums_in_expert_order():
    """Each token's contributions are summed in expert order (no atomic adds): the same bits on every call, and
    diffusers' sum."""
    layer = _layer()
    first, second, ref = _grouped_twice_and_diffusers(layer, torch.randn(300, 64))
    assert torch.equal(first, second)
    torch.testing.assert_close(first, ref, rtol=1e-5, atol=1e-5)


def test_held_experts_add_up_to_every_expert():
    """Expert parallel without its collectives: each rank's share of the experts (`held`; the others' weights on
    the host) contributes to every token what its experts give it, and the shares add up to the whole."""
    layer = _layer(experts=6)  # 3 per rank at two ranks
    x = torch.randn(50, 64)
    with torch.no_grad():
        index, weight, _ = layer.gate(x.unsqueeze(0))
        whole = GroupedSwiGLUExperts(layer.experts)(x, dispatch(index.view(-1), weight.view(-1), 2, 6))
        shares = []
        for held in (slice(0, 3), slice(3, 6)):
            experts = GroupedSwiGLUExperts(layer.experts, held)
            shares.append(experts(x, dispatch(index.view(-1), weight.view(-1), 2, 6, held)))
            experts.restore()
    torch.testing.assert_close(shares[0] + shares[1], whole, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_grouped_moe_repeats_itself_bit_for_bit_on_gpu():
    """Where atomic adds would land in a different order on every call: many tokens per expert, bf16."""
    layer = _layer("cuda", torch.bfloat16)
    first, second, ref = _grouped_twice_and_diffusers(layer, torch.randn(8192, 64, device="cuda",
                                                                          dtype=torch.bfloat16))
    assert torch.equal(first, second)
    assert ((first.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-2


@pytest.mark.gpu
def test_grouped_moe_on_gpu_has_no_host_sync():
    layer = _layer("cuda", torch.bfloat16)
    x = torch.randn(2, 1000, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = layer(x).float()
        experts = GroupedSwiGLUExperts(layer.experts)
        index, weight, _ = layer.gate(x)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            routed = dispatch(index.view(-1), weight.view(-1), layer.num_activated_experts, experts.num_experts)
            out = experts(x.view(-1, 64), routed).view_as(x) + layer.shared_experts(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-2


def _nucleus_layer(experts: int, capacity_factor: float, device: str, dtype: torch.dtype) -> NucleusMoELayer:
    torch.manual_seed(0)
    layer = NucleusMoELayer(32, 48, experts, capacity_factor, use_sigmoid=False, route_scale=2.5)
    with torch.no_grad():
        for weight in (layer.experts.gate_up_proj, layer.experts.down_proj):
            weight.uniform_(-weight.shape[1] ** -0.5, weight.shape[1] ** -0.5)
    return layer.to(device=device, dtype=dtype).eval()


def _check_expert_stores(device, dtype, n_ranks, seq_len, schedule, tolerance):
    """N simulated ranks run the X-Stage expert-parallel steps over a loopback fabric: each rank's tokens get what
    the whole layer gives them in one process."""
    layer = _nucleus_layer(2 * n_ranks, 2.0, device, dtype)
    batch, dim = 2, 32
    x, unmodulated = (torch.randn(batch, seq_len, dim, device=device, dtype=dtype) for _ in range(2))
    timestep = torch.randn(batch, dim, device=device, dtype=dtype)
    with torch.no_grad():
        expected = layer(x, unmodulated, timestep)
        router_input = torch.cat([timestep.unsqueeze(1).expand(-1, seq_len, -1), unmodulated], dim=-1)
        scores = torch.softmax(layer.gate(router_input).float(), dim=-1).to(dtype)
        selection = select(scores, layer.capacity_factor)
        scale = selection.weights * layer.route_scale
        local = ceil_div(seq_len, n_ranks)
        padded = F.pad(x, (0, 0, 0, n_ranks * local - seq_len))
        shared = layer.shared_expert(padded)
        share = layer.num_experts // n_ranks
        fabric = LoopbackFabric(n_ranks, device, initialise=lambda t: t.fill_(float("nan")))
        steps = [expert_steps(padded[:, r * local:(r + 1) * local].reshape(-1, dim),
                              shared[:, r * local:(r + 1) * local].reshape(-1, dim),
                              route_slots(selection.token, local, r), scale,
                              layer.experts.gate_up_proj[r * share:(r + 1) * share],
                              layer.experts.down_proj[r * share:(r + 1) * share], fabric.rank(r), schedule)
                 for r in range(n_ranks)]
        outs = run_in_lockstep(steps, fabric.rank(0).barrier)
    got = torch.cat([out.view(batch, local, dim) for out in outs], dim=1)[:, :seq_len]
    assert not got.isnan().any()
    assert ((got.float() - expected.float()).norm() / expected.float().norm()).item() < tolerance


@pytest.mark.gpu
def test_expert_choice_repeats_itself_bit_for_bit_on_gpu():
    """Released-size routing (64 experts, 4096 tokens, bf16 scores with ties) and the replicated layer: two calls
    on the same input give the same bits (what a CUDA graph's replay is checked against)."""
    torch.manual_seed(0)
    experts, tokens, dim, width = 64, 4096, 256, 128
    scores = torch.softmax(torch.randn(2, tokens, experts, device="cuda"), -1).to(torch.bfloat16)
    first, second = select(scores, 4.0), select(scores, 4.0)
    assert torch.equal(first.token, second.token) and torch.equal(first.weights, second.weights)
    hidden, shared = (torch.randn(2, tokens, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    gate_up = torch.randn(experts, dim, 2 * width, device="cuda", dtype=torch.bfloat16) * dim ** -0.5
    down = torch.randn(experts, width, dim, device="cuda", dtype=torch.bfloat16) * width ** -0.5
    call = ExpertChoiceCall(capacity_factor=4.0, route_scale=2.5, modes=ExpertModes.resolve(False, 1, False),
                            own=slice(0, experts))
    shard = SequenceShard(1, 0, None)
    outs = [run_expert_choice(hidden, shared, scores, gate_up, down, call, shard) for _ in range(2)]
    assert torch.equal(outs[0], outs[1])


def test_contributions_add_up_alike_with_and_without_triton(monkeypatch):
    torch.manual_seed(0)
    base, contributions = torch.randn(7, 32), torch.randn(12, 32)
    slots = torch.randint(-1, 12, (7, 4), dtype=torch.int32)
    kernel = add_contributions(base, contributions, slots)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU without Triton's interpreter: the torch sum
    plain = add_contributions(base, contributions, slots)
    expected = base + torch.stack([torch.where((s >= 0)[:, None], contributions[s], 0.0)
                                   for s in slots.long().unbind(1)]).sum(0)
    assert torch.allclose(kernel, expected, atol=1e-5) and torch.allclose(plain, expected, atol=1e-5)


@pytest.mark.parametrize("n_ranks", [2, 3])
def test_a_gather_over_a_fabric_stacks_every_ranks_rows(n_ranks):
    fabric = LoopbackFabric(n_ranks, "cpu", initialise=lambda t: t.fill_(float("nan")))
    parts = [torch.randn(5, 4) for _ in range(n_ranks)]
    for _ in range(2):  # the buffer is reused: the second gather's rows replace the first's
        parts = [part + 1 for part in parts]
        outs = run_in_lockstep([gather_steps(part, fabric.rank(r), "rows") for r, part in enumerate(parts)],
                               fabric.rank(0).barrier)
        assert all(torch.equal(out, torch.cat(parts)) for out in outs)


SCHEDULES = [ExpertSchedule(), ExpertSchedule(waves=2), ExpertSchedule(waves=2, interleaved=True)]


@pytest.mark.parametrize("n_ranks, seq_len", [(2, 20), (3, 19), (4, 13)])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_expert_parallel_stores_loopback_interpreted(n_ranks, seq_len, schedule):
    _check_expert_stores("cpu", torch.float32, n_ranks, seq_len, schedule, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("n_ranks, seq_len", [(2, 4096), (4, 4093)])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_expert_parallel_stores_loopback_on_gpu(n_ranks, seq_len, schedule):
    _check_expert_stores("cuda", torch.bfloat16, n_ranks, seq_len, schedule, 2e-2)


def test_expert_schedule_launches():
    none = range(0)
    assert ExpertSchedule(waves=2).launches(4) == [(range(0, 2), none), (none, range(0, 2)),
                                                   (range(2, 4), none), (none, range(2, 4))]
    assert ExpertSchedule(waves=2, interleaved=True).launches(4) == [
        (range(0, 2), none), (range(2, 4), range(0, 2)), (none, range(2, 4))]
    assert ExpertSchedule(waves=8, interleaved=True).launches(2) == [
        (range(0, 1), none), (range(1, 2), range(0, 1)), (none, range(1, 2))]
