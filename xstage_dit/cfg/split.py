"""Classifier-free-guidance parallelism: two groups of ranks compute the conditional and the unconditional
branch at the same time, then swap results, so every rank still gets both.

Pipelines do CFG in one of two ways, and a patch says which:
- "batch": one transformer call with the branches stacked along the batch (SD3, CogVideoX, LTX, ...): each
  CFG rank takes its slice of the batch and the outputs are gathered along the batch.
- "pairs": two calls per step, conditional then unconditional (Flux true CFG, Wan, HunyuanVideo, ...). CFG rank 1
  answers the first call at once with a tensor it fills later and computes the second call's branch while CFG
  rank 0 computes the first; after the second call the ranks swap outputs. This relies on the pipeline reading
  neither output before both calls returned (true of every supported pipeline) and on knowing, per pipeline call,
  whether CFG is on: a patch tells it from the pipeline's arguments."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.utils import BaseOutput
from torch import nn

from .plan import BATCH, PAIRS, CfgPlan
from ..logging_utils import warn_once
from ..hooks.module_forward import ReplacedForward, forward_signature
from ..runtime import ParallelGroups
from ..runtime.distributed import all_gather_into


def _sample(output: Any) -> torch.Tensor:
    return output.sample if isinstance(output, Transformer2DModelOutput) else output[0]


def _package(sample: Any, return_dict: bool) -> Any:
    return Transformer2DModelOutput(sample=sample) if return_dict else (sample,)


def _gather_batch(local: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    full = local.new_empty((groups.cfg_degree * local.shape[0], *local.shape[1:]))
    all_gather_into(full, local.contiguous(), groups.cfg_group)
    return full


def _gather_samples(local: torch.Tensor | list[torch.Tensor], groups: ParallelGroups) -> Any:
    """Every CFG group's samples in batch order: a batched tensor, or a list of one tensor per sample (Z-Image's
    output, samples of one shape)."""
    if isinstance(local, list):
        return list(_gather_batch(torch.stack(local), groups).unbind(0))
    return _gather_batch(local, groups)


def _gather_outputs(output: Any, groups: ParallelGroups) -> Any:
    """A forward's every output gathered along the batch, in its own packaging: a tuple, or a model output record
    (LTX-2 returns a video and an audio sample)."""
    if isinstance(output, BaseOutput):
        return type(output)(**{name: _gather_samples(value, groups) for name, value in output.items()})
    return tuple(_gather_samples(value, groups) for value in output)


def _batch_size(arguments: dict[str, Any], batch_inputs: dict[str, int]) -> int:
    name, dim = next(iter(batch_inputs.items()))
    value = arguments[name]
    return len(value) if isinstance(value, list) else value.shape[dim]


class PairedCalls:
    """State of the PAIRS schedule, shared by every transformer of one pipeline (Wan 2.2 switches models
    between steps, never inside one)."""

    def __init__(self) -> None:
        self.in_call = False  # inside a call of a pipeline that `enable` wrapped
        self.active = False  # ... that runs CFG
        self.calls = 0
        self.pending: torch.Tensor | None = None

    @contextlib.contextmanager
    def pipeline_call(self, uses_cfg: bool) -> Iterator[None]:
        self.in_call, self.active, self.calls, self.pending = True, uses_cfg, 0, None
        try:
            yield
        finally:
            self.in_call, self.active, self.pending = False, False, None


class CfgSplit:
    """Wraps one transformer's forward with the CFG split; `remove()` restores it."""

    def __init__(self, model: nn.Module, plan: CfgPlan, groups: ParallelGroups, pairs: PairedCalls) -> None:
        self.model = model
        self.plan = plan
        self.groups = groups
        self.pairs = pairs
        self._replaced = ReplacedForward(model, self._batch_forward if plan.mode == BATCH else self._paired_forward)
        self._forward = self._replaced.inner
        self._signature = forward_signature(model)
        # PAIRS sizes its placeholder output from the call's arguments before sequence sharding (whose hooks run
        # after this one); BATCH needs nothing per call
        self._output_shape: tuple[int, ...] = ()
        self._hook = (model.register_forward_pre_hook(self._record_output_shape, with_kwargs=True, prepend=True)
                      if plan.mode == PAIRS else None)

    def remove(self) -> None:
        if self._hook is not None:
            self._hook.remove()
        self._replaced.restore()

    def _record_output_shape(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        self._output_shape = self.plan.output_shape(model, self._signature.bind_partial(*args, **kwargs).arguments)

    def _batch_forward(self, *args: Any, **kwargs: Any) -> Any:
        bound = self._signature.bind(*args, **kwargs)
        arguments = bound.arguments
        batch = _batch_size(arguments, self.plan.batch_inputs)
        degree, rank = self.groups.cfg_degree, self.groups.cfg_rank
        if batch % degree:
            warn_once(f"xstage_dit: batch {batch} does not split over cfg_degree={degree}; every CFG group "
                      "computes the whole batch")
            return self._forward(*args, **kwargs)
        for name, dim in self.plan.batch_inputs.items():
            value = arguments.get(name)
            if isinstance(value, list) and len(value) == batch:
                arguments[name] = value[rank * batch // degree : (rank + 1) * batch // degree]
            elif isinstance(value, torch.Tensor) and value.dim() > dim and value.shape[dim] == batch:
                arguments[name] = value.chunk(degree, dim=dim)[rank]
            elif isinstance(value, dict):  # tensors by key (ControlNet residuals by block), its own dict type
                arguments[name] = type(value)((key, tensor.chunk(degree, dim=dim)[rank])
                                              for key, tensor in value.items())
        return _gather_outputs(self._forward(*bound.args, **bound.kwargs), self.groups)

    def _paired_forward(self, *args: Any, **kwargs: Any) -> Any:
        pairs = self.pairs
        if not pairs.in_call:
            warn_once("xstage_dit: a transformer enabled with cfg_degree=2 was called outside the pipeline that "
                      "enable wrapped (a pipeline made by from_pipe, or a direct call): every CFG group computes "
                      "every call; xstage_dit.enable(that_pipeline) with the same arguments splits its branches")
        if not pairs.active:
            return self._forward(*args, **kwargs)
        arguments = self._signature.bind(*args, **kwargs).arguments
        return_dict = arguments.get("return_dict", True)
        branch = pairs.calls % 2  # 0: conditional, 1: unconditional
        pairs.calls += 1
        mine = branch == self.groups.cfg_rank
        if branch == 0:
            if mine:
                pairs.pending = _sample(self._forward(*args, **kwargs))
            else:
                hidden = arguments["hidden_states"]
                shape = self._output_shape
                pairs.pending = torch.empty(shape, dtype=hidden.dtype, device=hidden.device)
            return _package(pairs.pending, return_dict)
        # second call: the unconditional rank computes, then both swap what they computed
        cond = pairs.pending
        computed = _sample(self._forward(*args, **kwargs)) if mine else cond
        both = _gather_batch(computed.unsqueeze(0), self.groups)
        if self.groups.cfg_rank != 0:
            cond.copy_(both[0])
        return _package(both[1] if not mine else computed, return_dict)
