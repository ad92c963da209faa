"""What the pipeline tests share: the tiny pipelines' sizes and batches, seeded calls, the worker that checks a
pipeline enabled on N ranks against one process, and the inputs of the transformers tested bare."""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple

import pytest
import torch
import torch.distributed as dist

import xstage_dit
from xstage_dit.testing import zoo
from numerics import relative_error
from xstage_dit import patches
from xstage_dit.hooks.layers import stack_of
from xstage_dit.runtime.distributed import ensure_process_group

# token counts: "even" divides by 2, 3 and 4; "uneven" (35 = 5 x 7) by none of them, except where a model's
# geometry cannot make 35 tokens (noted)
_VIDEO_SIZES = {"even": {"height": 32, "width": 32, "num_frames": 9},        # 3 frames x 2 x 2 = 12 tokens
                "uneven": {"height": 16, "width": 112, "num_frames": 17}}   # 5 frames x 1 x 7
SIZES = {
    "tiny-flux": {"even": {"height": 24, "width": 32, "num_frames": 1},     # 6 x 8 = 48 image tokens
                  "uneven": {"height": 20, "width": 28, "num_frames": 1}},  # 5 x 7
    "tiny-flux-kontext": {"even": {"height": 24, "width": 32, "num_frames": 1},  # 48 + 140 reference tokens
                          "uneven": {"height": 20, "width": 28, "num_frames": 1}},  # 35 + 140
    "tiny-wan": _VIDEO_SIZES,
    "tiny-wan2.2": _VIDEO_SIZES,
    "tiny-wan2.2-i2v": _VIDEO_SIZES,
    "tiny-wan2.1-i2v": _VIDEO_SIZES,
    "tiny-wan-vace": _VIDEO_SIZES,
    "tiny-hunyuan-video15": _VIDEO_SIZES,
    "tiny-hunyuan-video": _VIDEO_SIZES,
    "tiny-cogvideox": _VIDEO_SIZES,
    "tiny-qwenimage": {"even": {"height": 48, "width": 64, "num_frames": 1},   # 6 x 8
                       "uneven": {"height": 40, "width": 56, "num_frames": 1}},  # 5 x 7
    "tiny-sd3.5": {"even": {"height": 24, "width": 32, "num_frames": 1},   # 6 x 8
                   "uneven": {"height": 20, "width": 28, "num_frames": 1}},  # 5 x 7
    # LTX: sizes are multiples of 32 px, so tokens are multiples of 64: "uneven" only for N = 3 (320 tokens)
    "tiny-ltx": {"even": {"height": 32, "width": 32, "num_frames": 9},     # 3 x 8 x 8 = 192
                 "uneven": {"height": 32, "width": 32, "num_frames": 17}},  # 5 x 8 x 8 = 320
    # HiDream resizes every request to one area and pads non-square images to its max sequence (64 tokens here,
    # 55 of them image): "uneven" only for N = 3
    "tiny-hidream": {"even": {"height": 32, "width": 32, "num_frames": 1},
                     "uneven": {"height": 32, "width": 64, "num_frames": 1}},
}
SIZES["tiny-flux-fill"] = SIZES["tiny-flux-control"] = SIZES["tiny-flux"]  # images enter as channels
SIZES["tiny-nucleusmoe"] = SIZES["tiny-qwenimage-controlnet"] = SIZES["tiny-qwenimage"]  # its VAE and packing are Qwen-Image's
SIZES["tiny-flux2"] = SIZES["tiny-flux2-klein"] = SIZES["tiny-flux"]  # 2x VAE, 2x2 patches: 6 x 8 and 5 x 7
# Z-Image pads its image tokens to a multiple of 32: 96 tokens (6 x 16), and 35 made 64 ("uneven" only for N = 3)
SIZES["tiny-zimage"] = {"even": {"height": 24, "width": 64, "num_frames": 1},
                        "uneven": {"height": 20, "width": 28, "num_frames": 1}}
SIZES["tiny-chroma"] = SIZES["tiny-chroma-img2img"] = SIZES["tiny-flux"]
SIZES["tiny-flux-controlnet"] = SIZES["tiny-flux-multi-controlnet"] = SIZES["tiny-flux"]
SIZES["tiny-zimage-img2img"] = SIZES["tiny-zimage-inpaint"] = SIZES["tiny-zimage"]
SIZES["tiny-zimage-controlnet"] = SIZES["tiny-zimage-controlnet-inpaint"] = SIZES["tiny-zimage"]
SIZES["tiny-flux2-edit"] = SIZES["tiny-flux2-klein-kv"] = SIZES["tiny-flux"]  # + the reference image's tokens
# Qwen-Image Edit: about 1000 tokens of the input image besides these (its VAE downsamples 16x)
SIZES["tiny-qwenimage-edit"] = SIZES["tiny-qwenimage-edit-plus"] = SIZES["tiny-qwenimage-edit-2511"] = {
    "even": {"height": 64, "width": 96, "num_frames": 1},      # 2 x 3
    "uneven": {"height": 160, "width": 224, "num_frames": 1}}  # 5 x 7
SIZES["tiny-ltx-i2v"] = SIZES["tiny-ltx-condition"] = SIZES["tiny-ltx"]
# LTX-2: multiples of 32 px with an 8x VAE make 16 tokens a frame: "uneven" only for N = 3 (80 tokens)
# Qwen-Image 2.1: a token per 16 x 16 px, sizes multiples of 32 px: "uneven" only for N = 3 (40 tokens)
SIZES["tiny-qwenimage21"] = {"even": {"height": 64, "width": 96, "num_frames": 1},     # 4 x 6
                             "uneven": {"height": 64, "width": 160, "num_frames": 1}}  # 4 x 10
SIZES["tiny-ltx2"] = SIZES["tiny-ltx2-i2v"] = {
    "even": {"height": 32, "width": 32, "num_frames": 11},   # 6 frames x 4 x 4 = 96
    "uneven": {"height": 32, "width": 32, "num_frames": 9}}  # 5 x 4 x 4
SIZES["tiny-wan2.2-ti2v"] = {"even": {"height": 64, "width": 64, "num_frames": 9},     # 3 frames x 2 x 2 (16x VAE)
                             "uneven": {"height": 32, "width": 224, "num_frames": 17}}  # 5 x 1 x 7
# EditPlus takes one prompt at a time; Edit's batches are other families' (its ~1024² input image is slow here)
BATCHES = {"tiny-qwenimage-edit": (1,), "tiny-qwenimage-edit-plus": (1,), "tiny-qwenimage-edit-2511": (1,),
           "tiny-wan-vace": (1,),  # WanVACEPipeline generates one video per call
           "tiny-zimage-controlnet-inpaint": (1,)}  # its pipeline does not repeat a mask per prompt
TOLERANCE = 1e-4


def seeded_latents(pipe, name: str, size: str, steps: int, guidance: float, text_seed: int = 2,
                   noise_seed: int = 8) -> Callable[[], torch.Tensor]:
    """A call of `pipe` at SIZES[name][size] with seeded prompt embeddings and noise, returning its latents: every
    call (and every rank's) computes the same one."""
    kwargs = zoo.call_kwargs(name, **SIZES[name][size], steps=steps, guidance=guidance)

    def generate() -> torch.Tensor:
        return pipe(**kwargs, **zoo.text_embeddings(name, 1, seed=text_seed), output_type="latent",
                    generator=torch.Generator().manual_seed(noise_seed), return_dict=False)[0]

    return generate


def _first_attention(pipe) -> list[torch.nn.Module]:
    """The first routed attention module (image-only queries) of every transformer (Wan 2.2 has two)."""
    models = [m for m in (pipe.transformer, getattr(pipe, "transformer_2", None)) if m is not None]
    return [patches.plan_for(m).attention_modules(m)[0] for m in models]


def pipeline_worker(name: str, cfg_degree: int = 1, guidance: float = 3.0, backend: str = "reference",
                     expert_parallel: bool = False, every_case: bool | None = True,
                     degrees: dict | None = None) -> None:
    pipe = zoo.build_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    # query rows that reach each transformer's first routed attention, per call: proves the sequence is split
    tokens_seen: dict[int, set[int]] = {}
    for index, attention in enumerate(_first_attention(pipe)):
        attention.register_forward_pre_hook(
            lambda module, args, kwargs, index=index: tokens_seen.setdefault(index, set()).add(
                kwargs.get("hidden_states", args[0] if args else None).shape[1]),
            with_kwargs=True,
        )

    def generate(batch: int, size: str) -> tuple[list[torch.Tensor], dict[int, set[int]]]:
        """Every latent output (LTX-2's video and audio) and the token counts seen."""
        tokens_seen.clear()
        kwargs = zoo.call_kwargs(name, **SIZES[name][size], steps=2, guidance=guidance)
        outs = pipe(**kwargs, **zoo.text_embeddings(name, batch, seed=batch), output_type="latent",
                    generator=torch.Generator().manual_seed(7), return_dict=False)
        return [out for out in outs if isinstance(out, torch.Tensor)], dict(tokens_seen)

    batches = BATCHES.get(name, (1, 2))
    # every batch at every size; or each batch and each size once (the largest batch at the uneven size); or
    # (every_case None) that last case alone
    cases = ([(batch, size) for batch in batches for size in ("even", "uneven")] if every_case
             else [(batches[0], "even"), (batches[-1], "uneven")][every_case is None:])
    stock, own = _shared_stock(generate, cases)

    every_expert = _routed_expert_weights(pipe.transformer)
    xstage_dit.enable(pipe, cfg_degree=cfg_degree, backend=backend, timeout_s=120, expert_parallel=expert_parallel,
                      **(degrees or {}))
    if expert_parallel:  # this rank's share of the experts is all its device holds
        degree = torch.distributed.get_world_size() // cfg_degree
        assert _routed_expert_weights(pipe.transformer) * degree == every_expert
    degree = torch.distributed.get_world_size() // cfg_degree
    for case in cases:
        out, tokens = generate(*case)
        ref, full_tokens = stock[case]
        assert len(out) == len(ref)
        error = max(relative_error(o, r) for o, r in zip(out, ref))
        assert error < TOLERANCE, f"{name} {cfg_degree}x{degree} batch/size={case}: relative error {error:.2e}"
        full = set.union(*full_tokens.values())
        # the split tokens are those of the call that sees the fewest; a call that sees more holds the rest whole
        # (Qwen-Image 2.1's first step also prefills its prompt prefix); with the CFG split a rank may skip a
        # transformer's calls entirely (the other branch's rank runs them)
        split = min(full)
        expected = {index: {n - split + math.ceil(split / degree) for n in full} for index in tokens}
        assert tokens == expected, f"{name}: transformers' blocks saw {tokens} tokens of {full}"

    xstage_dit.disable(pipe)
    out, tokens = generate(*own.case)
    assert all(torch.equal(o, r) for o, r in zip(out, own.result[0])) and tokens == own.result[1], \
        "disable did not restore the model"


class OwnStock(NamedTuple):
    case: tuple  # (batch, size)
    result: tuple  # what generate returned for it on this rank


def _shared_stock(generate: Callable[[int, str], tuple], cases: list[tuple]) -> tuple[dict, OwnStock]:
    """Every case's stock result, each computed on one rank (rank r: cases r, r + N, ...) and shared; and one that
    this rank computed itself (with fewer cases than ranks, case r mod their number), which `disable` must
    reproduce bit for bit."""
    ensure_process_group(120.0)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {case: generate(*case) for case in cases[rank::world] or [cases[rank % len(cases)]]}
    shares: list[dict] = [{}] * world
    dist.all_gather_object(shares, {case: out for case, out in mine.items() if cases.index(case) % world == rank})
    stock = {case: out for share in shares for case, out in share.items()}
    own = next(iter(mine))
    return stock, OwnStock(own, mine[own])


def _routed_expert_weights(model: torch.nn.Module) -> int:
    """Elements of the routed experts' weights a model holds (NucleusMoE's packed experts, HiDream's list)."""
    return sum(p.numel() for name, module in model.named_modules() if name.endswith(".experts")
               for p in module.parameters())


def pipelines_worker(names: list[str], cfg_degree: int = 1, guidance: float = 3.0,
                      backend: str = "reference", expert_parallel: bool = False, every_case: bool | None = True,
                      degrees: dict | None = None) -> None:
    """One spawn of ranks checks several pipelines in turn (a spawn's start-up costs more than a tiny pipeline)."""
    for name in names:
        pipeline_worker(name, cfg_degree, guidance, backend, expert_parallel, every_case, degrees)


def bare_transformer_inputs(name: str, generator: torch.Generator) -> dict:
    """Direct transformer inputs with 35 image/video tokens (5 x 7), which no degree 2..4 divides."""
    entry = zoo.ZOO[name]
    if entry.family == "flux":
        return {
            "hidden_states": torch.randn(2, 35, 16, generator=generator),
            "encoder_hidden_states": torch.randn(2, 5, 32, generator=generator),
            "pooled_projections": torch.randn(2, 32, generator=generator),
            "timestep": torch.tensor([0.5, 0.5]), "guidance": torch.tensor([3.5, 3.5]),
            "img_ids": torch.randn(35, 3, generator=generator), "txt_ids": torch.zeros(5, 3),
        }
    # LTX: the pipeline only makes multiples of 64 tokens; the model itself takes any latent grid
    mask = torch.ones(2, 6)
    mask[1, 4:] = 0
    return {
        "hidden_states": torch.randn(2, 35, 8, generator=generator),
        "encoder_hidden_states": torch.randn(2, 6, 32, generator=generator),
        "timestep": torch.tensor([500, 500]), "encoder_attention_mask": mask,
        "num_frames": 1, "height": 5, "width": 7,
    }


# LTX-2 at the transformer (its pipelines' text connectors, audio VAE and vocoder are not in the zoo)
LTX2_CONFIG = {"in_channels": 8, "out_channels": 8, "num_attention_heads": 12, "attention_head_dim": 8,
         "cross_attention_dim": 96, "audio_in_channels": 8, "audio_out_channels": 8, "audio_num_attention_heads": 4,
         "audio_attention_head_dim": 8, "audio_cross_attention_dim": 32, "num_layers": 2, "caption_channels": 32,
         "perturbed_attn": True}


@dataclasses.dataclass
class FirstBlockStatistics:
    """Per step after the first, FirstBlockCache's statistic over every rank's own tokens alone (what each rank
    would decide on without the shared decision: [step][rank]) and over the whole sequence ([step])."""

    alone: list[list[float]]
    whole: list[float]


def local_statistics(pipe, generate) -> FirstBlockStatistics:
    """FirstBlockCache's statistics in a call of the enabled pipeline, gathered from the ranks."""
    from diffusers.hooks._helpers import TransformerBlockRegistry

    block = pipe.transformer.transformer_blocks[0] if hasattr(pipe.transformer, "transformer_blocks") \
        else pipe.transformer.blocks[0]
    index = TransformerBlockRegistry.get(type(block)).return_hidden_states_index
    residuals = []

    def record(module, args, kwargs, output):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        out = output[index] if isinstance(output, tuple) else output
        residuals.append((out - hidden).detach())

    handle = block.register_forward_hook(record, with_kwargs=True)
    generate()
    handle.remove()
    (decisions,) = stack_of(pipe.transformer).changes_of("cache decisions")
    shard = decisions.shard
    valid = min(shard.local_len, shard.seq_len - shard.rank * shard.local_len)
    # per step: the sums of |r - p| and of |p| over this rank's tokens
    mine = torch.tensor([[(r - p)[:, :valid].abs().sum().item(), p[:, :valid].abs().sum().item()]
                         for p, r in zip(residuals, residuals[1:])], dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(everyone, mine)
    sums = torch.stack(everyone, dim=1)  # [step][rank][difference, previous]
    whole = sums.sum(dim=1)
    return FirstBlockStatistics((sums[..., 0] / sums[..., 1]).tolist(), (whole[:, 0] / whole[:, 1]).tolist())


# Qwen-Image 2.1 at the transformer (its pipeline's Qwen3-VL encoder and processor are not in the zoo)
QWENIMAGE21_CONFIG = {"in_channels": 8, "out_channels": 8, "num_layers": 2, "attention_head_dim": 16,
                      "num_attention_heads": 12, "context_in_dim": 24, "axes_dims_rope": (4, 6, 6)}


def qwenimage21_inputs(height: int, width: int, generator: torch.Generator) -> dict:
    """Batch 2: prompts of 9 vision-language positions around one 4x2 condition image (2 slots), the second
    prompt padded; the target image height x width appended (one slot per 2x2 tokens), as the pipeline builds
    them."""
    condition, target = (1, 4, 2), (1, height, width)
    slots = torch.tensor([False] * 3 + [True] * 2 + [False] * 4)
    img_mask = torch.cat([slots, torch.ones(height * width // 4, dtype=torch.bool)]).expand(2, -1)
    text_mask = torch.ones(2, slots.numel(), dtype=torch.bool)
    text_mask[1, -2:] = False
    return dict(hidden_states=torch.randn(2, 8 + height * width, 8, generator=generator),
                encoder_hidden_states=torch.randn(2, slots.numel(), 24, generator=generator),
                timestep=torch.tensor([0.7, 0.4]), img_shapes=[[condition, target]] * 2, img_mask=img_mask,
                encoder_hidden_states_mask=text_mask, return_dict=False)


def per_pipeline(table: dict) -> list:
    """One test item per pipeline of a table {key or tuple of keys: [pipeline names]}: a failure names its pipeline
    and hides no other, and `-k` picks one (the ranks start from a preloaded server: an item costs little more)."""
    return [pytest.param(*(key if isinstance(key, tuple) else (key,)), name,
                         id="-".join(map(str, key if isinstance(key, tuple) else (key,))) + f"-{name}")
            for key, names in table.items() for name in names]
