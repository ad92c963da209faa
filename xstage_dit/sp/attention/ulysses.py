"""The attention entry point a patched model's processors call instead of diffusers' dispatcher."""
from __future__ import annotations

import torch

from ...kernels.rotary_args import JointTokens
from ...precision.steps import StepPrecision
from .backends import BackendChoice, may_take_joint_tokens
from .layout import UlyssesLayout, WholeKeys
from .local import diffusers_attention
from .masks import QueryKeyMasks, text_key_mask
from .ops import gathered_keys_attention, local_attention, prologue_kernels_run, ulysses_attention
from ...runtime.distributed import Axis
from ..sharding import SequenceShard


class UlyssesAttention:
    """Ulysses attention for one model: knows the model's token split and the backend choice, not the model. The
    split's ranks may form a ring of Ulysses groups (`ring`, ring.py); by default they are one Ulysses group.
    `local_cross_attention`: the model's calls whose queries and keys differ in count are cross-attention over
    keys every rank holds whole (SequenceParallelPlan.local_cross_attention). `precision`: the model's step
    precision (precision/steps.py), which says at each call whether it attends with `fp8_choice` (the FP8 variant
    of the choice, enable(fp8="attention")) and whether its exchanges send FP8 payloads where the strategy can
    (enable(fp8="payloads")): the full-precision steps do neither."""

    def __init__(self, shard: SequenceShard, choice: BackendChoice, text_first: bool = True,
                 query_key_masks: QueryKeyMasks | None = None, ulysses: Axis | None = None,
                 ring: Axis = Axis(), local_cross_attention: bool = False, precision: StepPrecision | None = None,
                 fp8_choice: BackendChoice | None = None) -> None:
        self.shard = shard
        self.native_choice = choice
        self.precision = StepPrecision() if precision is None else precision
        self.fp8_choice = fp8_choice
        self.text_first = text_first
        self.query_key_masks = query_key_masks
        self.ulysses = Axis(shard.degree, shard.rank, shard.group) if ulysses is None else ulysses
        self.ring = ring
        self.local_cross_attention = local_cross_attention

    @property
    def choice(self) -> BackendChoice:
        """What attends now: the FP8 variant while the model's step runs attention in FP8, else the choice."""
        if self.fp8_choice is not None and self.precision.fp8("attention"):
            return self.fp8_choice
        return self.native_choice

    @property
    def fp8_payloads(self) -> bool:
        """Whether the exchanges send FP8 payloads now (where the strategy can): while the model's step runs
        payloads in FP8."""
        return self.precision.fp8("payloads")

    def routes(self, queries: int, keys: int) -> bool:
        """Whether a call of `queries` queries over `keys` keys is this attention's: not one within a prefix every
        rank holds whole (SequenceShard.whole_prefix_len), nor, where the model's cross-attention is local, one
        whose keys are not the queries' tokens; the model's own attention computes those as one process does."""
        if self.local_cross_attention and queries != keys:
            return False
        return keys > self.shard.whole_prefix_len

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        attention_backend: str | None = None,
    ) -> torch.Tensor:
        """`attention_backend`: the diffusers attention backend set on the model (`set_attention_backend`), which
        then attends in place of our choice's degree-1 kernel, and of the gathered heads' SDPA at higher degrees."""
        if dropout_p or is_causal:
            raise ValueError("xstage_dit attention is for inference: dropout and causal masks are not supported")
        if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
            raise NotImplementedError(
                f"xstage_dit: an attention mask of type {type(attn_mask).__name__} (a flex-attention processor's, "
                "over the whole sequence) cannot be split between ranks; set the model's SDPA processor back (e.g. "
                "QwenImage21AttnProcessor), or run it on one rank")
        attn_mask = _four_dims(attn_mask)
        pair_bias = attn_mask is not None and self.query_key_masks is QueryKeyMasks.PAIR_BIAS
        shard = self.shard
        if attn_mask is not None and self.query_key_masks is not None and not (pair_bias and shard.degree == 1):
            attn_mask = attn_mask[:, :, :1]  # the first (always valid) query's row
        if shard.degree == 1:  # a pair bias is the model's own mask, whole
            if attention_backend is not None:
                return diffusers_attention(attention_backend)(query, key, value, attn_mask, scale)
            return local_attention(query, key, value, attn_mask, backend=self.choice.name, scale=scale,
                                   pair_bias=pair_bias)
        layout = self._layout(query.shape[1], key.shape[1])
        return ulysses_attention(JointTokens((query,)), JointTokens((key,)), JointTokens((value,)), layout,
                                 text_mask=text_key_mask(attn_mask, layout), backend=self.choice.name,
                                 group=self.ulysses.group, scale=scale, attention_backend=attention_backend,
                                 pair_bias=pair_bias, ring_group=self.ring.group, fp8_payloads=self.fp8_payloads)

    def joint(self, query: JointTokens, key: JointTokens, value: JointTokens, attn_mask: torch.Tensor | None = None,
              scale: float | None = None, attention_backend: str | None = None) -> torch.Tensor | None:
        """Attention of q, k, v held as JointTokens (q and k with a norm + RoPE, v without), where this call can
        take them (`takes_joint_tokens`, and our kernels take their norm + rotation: ops.prologue_kernels_run). None
        otherwise: the caller joins them and calls as usual."""
        if not self.takes_joint_tokens(query.parts[0].device) or not all(map(prologue_kernels_run, (query, key))):
            return None
        layout = self._layout(query.rows, key.rows)
        return ulysses_attention(query, key, value, layout, text_mask=text_key_mask(_four_dims(attn_mask), layout),
                                 backend=self.choice.name, group=self.ulysses.group, scale=scale,
                                 attention_backend=attention_backend, fp8_payloads=self.fp8_payloads)

    def with_whole_keys(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, whole: WholeKeys,
                        scale: float | None = None) -> torch.Tensor | None:
        """Attention of q, k, v laid out as this attention's calls are, over keys and values every rank holds
        whole (`whole`, of every head) besides the sequence's (at ring degree 1 with the gathered keys, in a ring
        merged like a block); None where the tokens are not split (the caller attends over all the keys
        itself)."""
        if self.shard.degree == 1:
            return None
        layout = self._layout(query.shape[1], key.shape[1])
        return ulysses_attention(JointTokens((query,)), JointTokens((key,)), JointTokens((value,)), layout,
                                 text_mask=None, backend=self.choice.name, group=self.ulysses.group, scale=scale,
                                 attention_backend=None, ring_group=self.ring.group, whole=whole,
                                 fp8_payloads=self.fp8_payloads)

    def takes_joint_tokens(self, device: torch.device) -> bool:
        """What `joint` asks before it looks at the tensors: a Ulysses degree above 1, no masks over query-key
        pairs, and a backend of the choice that takes JointTokens on `device`."""
        return (self.shard.degree > 1 and self.ring.degree == 1 and self.query_key_masks is None
                and may_take_joint_tokens(self.choice, device))

    def _layout(self, query_rows: int, key_rows: int) -> UlyssesLayout:
        shard = self.shard
        # split text tokens lead each rank's chunk and count as sequence tokens; whole text stays `text_len`
        local_len = shard.local_text_len + shard.local_len
        return UlyssesLayout(
            text_len=key_rows - local_len,
            seq_len=shard.text_len + shard.seq_len,
            local_len=local_len,
            degree=self.ulysses.degree,
            rank=self.ulysses.rank,
            text_first=self.text_first,
            text_queries=query_rows == key_rows,
            ring_degree=self.ring.degree,
            ring_rank=self.ring.rank,
        )


def _four_dims(attn_mask: torch.Tensor | None) -> torch.Tensor | None:
    """A key-padding mask given as (B, keys) as (B, 1, 1, keys); others as they are."""
    return attn_mask[:, None, None, :] if attn_mask is not None and attn_mask.dim() == 2 else attn_mask


class GatheredKeysAttention:
    """Attention whose queries every rank holds whole, over keys and values split with the tokens (LTX-2's audio
    attending to every video token): the keys and values are gathered, every rank computes the whole output.
    Same call as UlyssesAttention's, for the router; marked on modules only where the tokens are split."""

    def __init__(self, shard: SequenceShard) -> None:
        self.shard = shard

    def routes(self, queries: int, keys: int) -> bool:
        return True

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                 scale: float | None = None, attention_backend: str | None = None) -> torch.Tensor:
        if dropout_p or is_causal or attn_mask is not None:
            raise ValueError("xstage_dit: attention over gathered keys takes no mask, dropout or causal masking")
        return gathered_keys_attention(query, key, value, self.shard, scale=scale,
                                       attention_backend=attention_backend)
