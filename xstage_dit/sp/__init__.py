"""Sequence-parallel core: token sharding, Ulysses attention and its backends, plans applied to models."""
