"""The grouped, sync-free MoE equals diffusers' HiDream `moe_infer` (which loops over experts sized on the host);
the X-Stage expert-parallel steps over a loopback fabric equal NucleusMoE's layer in one process."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU
from diffusers.models.transformers.transformer_nucleusmoe_image import NucleusMoELayer

from xstage_dit.moe import GroupedSwiGLUExperts, dispatch
from xstage_dit.sp.expert_choice import select
from xstage_dit.sp.expert_exchange import expert_steps, route_slots
from xstage_dit.sp.fabric import LoopbackFabric, run_in_lockstep
from xstage_dit.xstage.planner import ExpertSchedule


def _layer(device: str = "cpu", dtype: torch.dtype = torch.float32) -> MOEFeedForwardSwiGLU:
    torch.manual_seed(0)
    return MOEFeedForwardSwiGLU(dim=64, hidden_dim=96, num_routed_experts=5, num_activated_experts=2).to(
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
        local = -(-seq_len // n_ranks)
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
