"""The grouped, sync-free MoE equals diffusers' HiDream `moe_infer` (which loops over experts sized on the host)."""
from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

from xstage_dit.moe import GroupedSwiGLUExperts, dispatch


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
