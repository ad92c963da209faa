"""diffusers' hooks find what a block or an attention processor is by its class (hooks/_helpers.py: which output
of a block holds the hidden states, what a skipped processor returns). A class of ours that stands in for one of
diffusers' on a module while a model is enabled is registered with the metadata of the class it stands in for, so
that a cache enabled while it is in place (FirstBlockCache, MagCache, LayerSkip, ...) finds it."""
from __future__ import annotations

import copy

from diffusers.hooks._helpers import AttentionProcessorRegistry, TransformerBlockRegistry


def register_like(cls: type, original: type) -> None:
    """`cls` known to diffusers' block and processor registries as `original` is, where `original` is known."""
    for registry in (TransformerBlockRegistry, AttentionProcessorRegistry):
        try:
            metadata = registry.get(original)
        except ValueError:  # diffusers does not know `original` either
            continue
        try:
            registry.get(cls)
        except ValueError:
            registry.register(cls, copy.copy(metadata))
            if hasattr(metadata, "_cls"):  # arguments are found by name in the signature of the class stood in for
                registry.get(cls)._cls = original
