"""Process-group set-up from the torchrun / accelerate environment."""
from .distributed import ParallelGroups, build_groups, ensure_process_group, world_from_env

__all__ = ["ParallelGroups", "build_groups", "ensure_process_group", "world_from_env"]
