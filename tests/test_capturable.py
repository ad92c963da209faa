"""Stand-ins that keep a family's forward free of host-to-device copies (which a CUDA graph cannot hold) compute
what diffusers' code does, bit for bit, and are undone by `disable`."""
from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers import transformer_chroma, transformer_qwenimage

import xstage_dit
from xstage_dit.testing import zoo
from xstage_dit.patches.image.chroma import DeviceGuidanceEmbeddings
from xstage_dit.patches.image.qwenimage import text_lengths_without_copy


def test_chroma_guidance_term_on_the_device_equals_diffusers():
    pipe = zoo.build_pipeline("tiny-chroma")
    embeddings = pipe.transformer.time_text_embed
    timestep = torch.rand(3) * 1000
    expected = embeddings(timestep)
    xstage_dit.enable(pipe)
    try:
        assert type(embeddings) is DeviceGuidanceEmbeddings
        assert torch.equal(embeddings(timestep), expected)
    finally:
        xstage_dit.disable(pipe)
    assert type(embeddings) is transformer_chroma.ChromaCombinedTimestepTextProjEmbeddings


@pytest.mark.parametrize("padding", [0, 3, 8])  # no padding, some, a prompt without any valid token
def test_qwenimage_text_lengths_without_copy_equal_diffusers(padding):
    original = transformer_qwenimage.compute_text_seq_len_from_mask
    states = torch.randn(2, 8, 4)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 8 - padding:] = 0
    ours = text_lengths_without_copy(original)
    for given in (mask, mask.bool(), None):
        expected, got = original(states, given), ours(states, given)
        assert expected[0] == got[0]
        for a, b in zip(expected[1:], got[1:]):
            assert (a is None and b is None) or (torch.equal(a, b) and a.dtype == b.dtype)
    with pytest.raises(ValueError, match="must match"):
        ours(states, mask[:, :5])


def test_qwenimage_enable_rebinds_the_text_lengths_until_disable():
    original = transformer_qwenimage.compute_text_seq_len_from_mask
    pipes = [zoo.build_pipeline("tiny-qwenimage") for _ in range(2)]
    for pipe in pipes:
        xstage_dit.enable(pipe)
    assert transformer_qwenimage.compute_text_seq_len_from_mask is not original
    xstage_dit.disable(pipes[0])  # the other model still holds the binding
    assert transformer_qwenimage.compute_text_seq_len_from_mask is not original
    xstage_dit.disable(pipes[1])
    assert transformer_qwenimage.compute_text_seq_len_from_mask is original
