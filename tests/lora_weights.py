"""Random LoRA adapters for the tiny pipelines' layers, as the adapter tests load them, and the seeded call those
tests compare."""
from __future__ import annotations

import torch
from torch import nn

from xstage_dit.testing import zoo


RANK = 4


# adapter "a" (loaded before enable) trains every layer named; "b" (loaded after) some of them, none of FLUX.1's
# proj_out: with "b" alone the split projection computes its block again
ADAPTERS = {
    "tiny-flux": {
        "a": ["single_transformer_blocks.0.proj_out", "single_transformer_blocks.0.proj_mlp",
              "single_transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.attn.to_k",
              "single_transformer_blocks.0.attn.to_v", "transformer_blocks.0.ff.net.0.proj",
              "transformer_blocks.0.ff_context.net.0.proj", "transformer_blocks.0.attn.to_q",
              "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_v", "transformer_blocks.0.attn.to_out.0",
              "transformer_blocks.0.attn.add_q_proj"],
        "b": ["single_transformer_blocks.0.proj_mlp", "single_transformer_blocks.0.attn.to_v",
              "transformer_blocks.0.ff.net.0.proj", "transformer_blocks.0.attn.to_out.0"],
    },
    "tiny-wan": {
        "a": ["blocks.0.attn1.to_q", "blocks.0.attn1.to_k", "blocks.0.attn1.to_v", "blocks.0.attn1.to_out.0",
              "blocks.0.attn2.to_k", "blocks.0.ffn.net.0.proj", "blocks.1.ffn.net.0.proj"],
        "b": ["blocks.0.attn1.to_q", "blocks.1.attn1.to_out.0", "blocks.1.ffn.net.0.proj"],
    },
    "tiny-qwenimage": {
        "a": ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_v",
              "transformer_blocks.0.attn.to_out.0", "transformer_blocks.0.attn.add_q_proj",
              "transformer_blocks.0.img_mlp.net.0.proj", "transformer_blocks.0.txt_mlp.net.0.proj"],
        "b": ["transformer_blocks.0.attn.to_q", "transformer_blocks.1.img_mlp.net.0.proj"],
    },
    # routed experts, whose weights the grouped MoE stacks, and a shared one
    "tiny-hidream": {
        "a": ["double_stream_blocks.0.block.ff_i.experts.1.w1", "double_stream_blocks.0.block.ff_i.experts.2.w2",
              "double_stream_blocks.0.block.ff_i.experts.3.w3", "double_stream_blocks.0.block.ff_i.shared_experts.w1",
              "double_stream_blocks.0.block.attn1.to_q", "single_stream_blocks.0.block.attn1.to_v"],
        "b": ["single_stream_blocks.0.block.ff_i.experts.0.w1", "double_stream_blocks.0.block.ff_i.experts.1.w1"],
    },
    # the single-stream block's fused q/k/v + MLP projection and the SwiGLU feed-forwards
    "tiny-flux2": {
        "a": ["single_transformer_blocks.0.attn.to_qkv_mlp_proj", "single_transformer_blocks.0.attn.to_out",
              "transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_v",
              "transformer_blocks.0.attn.to_out.0", "transformer_blocks.0.attn.add_k_proj",
              "transformer_blocks.0.ff.linear_in", "transformer_blocks.0.ff_context.linear_out"],
        "b": ["single_transformer_blocks.0.attn.to_qkv_mlp_proj", "transformer_blocks.0.ff.linear_in"],
    },
    "tiny-zimage": {
        "a": ["layers.0.attention.to_q", "layers.0.attention.to_k", "layers.0.attention.to_v",
              "layers.0.attention.to_out.0", "layers.0.feed_forward.w1", "layers.0.feed_forward.w3",
              "noise_refiner.0.attention.to_q", "context_refiner.0.feed_forward.w2"],
        "b": ["layers.1.attention.to_v", "layers.0.feed_forward.w1"],
    },
    # the single-stream projections that FLUX.1 splits are diffusers' own here
    "tiny-hunyuan-video": {
        "a": ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_v",
              "transformer_blocks.0.attn.to_out.0", "transformer_blocks.0.attn.add_q_proj",
              "transformer_blocks.0.ff.net.0.proj", "single_transformer_blocks.0.attn.to_q",
              "single_transformer_blocks.0.proj_mlp", "single_transformer_blocks.0.proj_out"],
        "b": ["transformer_blocks.0.ff.net.0.proj", "single_transformer_blocks.0.attn.to_k"],
    },
}
ADAPTERS["tiny-chroma"] = ADAPTERS["tiny-flux"]  # the same blocks; its padded prompts bring a text mask


def lora_state_dict(model: nn.Module, targets: list[str], seed: int) -> dict[str, torch.Tensor]:
    """A rank-`RANK` LoRA for the Linear layers `targets` of `model`, in the diffusers naming that the pipelines'
    `load_lora_weights` takes; random A and B (B is zero in a fresh adapter: then it would change nothing)."""
    generator = torch.Generator().manual_seed(seed)
    layers = dict(model.named_modules())
    state = {}
    for target in targets:
        layer = layers[target]
        state[f"transformer.{target}.lora_A.weight"] = torch.randn(RANK, layer.in_features, generator=generator) * 0.2
        state[f"transformer.{target}.lora_B.weight"] = torch.randn(layer.out_features, RANK, generator=generator) * 0.2
    return state


SIZES = {"tiny-flux": {"height": 20, "width": 28, "num_frames": 1},      # 5 x 7 image tokens
         "tiny-wan": {"height": 16, "width": 112, "num_frames": 17},     # 5 frames x 1 x 7
         "tiny-qwenimage": {"height": 40, "width": 56, "num_frames": 1},  # 5 x 7
         "tiny-hidream": {"height": 32, "width": 32, "num_frames": 1},
         "tiny-nucleusmoe": {"height": 40, "width": 56, "num_frames": 1},
         "tiny-zimage": {"height": 20, "width": 28, "num_frames": 1},       # 35 image tokens, padded to 64
         "tiny-hunyuan-video": {"height": 16, "width": 112, "num_frames": 17}}  # 5 frames x 1 x 7
SIZES["tiny-chroma"] = SIZES["tiny-flux2"] = SIZES["tiny-flux"]


def generate_latents(pipe, name: str) -> torch.Tensor:
    kwargs = zoo.call_kwargs(name, **SIZES[name], steps=2, guidance=3.0)
    embeddings = zoo.text_embeddings(name, 1, seed=1, device=pipe.device, dtype=pipe.transformer.dtype)
    return pipe(**kwargs, **embeddings, output_type="latent", generator=torch.Generator().manual_seed(7),
                return_dict=False)[0]
