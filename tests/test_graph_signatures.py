"""runtime/cuda_graphs.py on the host: what a call's signature holds, and which modules count as a model's
blocks (their graphs run on a GPU: tests/test_cuda_graphs.py)."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from xstage_dit.testing import zoo
from xstage_dit.runtime.cuda_graphs import _signature, repeated_blocks

CPU = torch.device("cpu")


def _key(*args, state=None, **kwargs):
    leaves, spec = tree_flatten((args, kwargs))
    return _signature(leaves, spec, CPU, state)


def test_a_signature_holds_shapes_plain_values_and_the_host_state():
    x = torch.zeros(2, 3)
    assert _key(x, 1.0, mode="a") == _key(torch.ones(2, 3), 1.0, mode="a")
    assert _key(x, 1.0) != _key(torch.zeros(2, 4), 1.0)
    assert _key(x, 1.0) != _key(x, 2.0)
    assert _key(x, cut=slice(0, 4)) == _key(x, cut=slice(0, 4)) != _key(x, cut=slice(0, 5))
    assert _key(x, state=(4, 0, 0)) != _key(x, state=(6, 0, 0))


def test_an_object_argument_is_refused_with_its_type():
    class Cache:
        pass

    assert _key(torch.zeros(1), cache=Cache()) == ("an argument of type Cache, whose contents a graph could not "
                                                   "follow")


def test_blocks_are_the_repeated_classes_outermost_instances():
    model = zoo.build_pipeline("tiny-qwenimage-edit-2511").transformer
    blocks = repeated_blocks(model)
    assert blocks == list(model.transformer_blocks) and len(blocks) == 2
    # tiny Flux has one block of each class: nothing repeats
    assert repeated_blocks(zoo.build_pipeline("tiny-flux").transformer) == []


def test_a_block_inside_a_block_is_not_one_of_its_own():
    class Inner(torch.nn.Module):
        pass

    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.ModuleList([Inner(), Inner()])

    class Model(torch.nn.Module):
        _repeated_blocks = ["Outer", "Inner"]

        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([Outer(), Outer()])

    model = Model()
    assert repeated_blocks(model) == list(model.blocks)
