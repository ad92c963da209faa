"""Sizes that modules on different floors must compute alike, defined once here, below all of them: how a length
splits into equal parts (a sequence's tokens per rank: sp/sharding.py splits tensors by it, the planner predicts
with it)."""
from __future__ import annotations


def ceil_div(numerator: int, denominator: int) -> int:
    """ceil(numerator / denominator) in integers: the tokens each of `denominator` ranks holds of a sequence split
    along its length (the tail padded so that every rank holds as many)."""
    return -(-numerator // denominator)
