"""What the launcher (torchrun, accelerate launch, or none: one process) tells a process through its environment,
read without torch: the job's size and this process's rank. The command lines check their arguments against the
job with it before anything loads; runtime/distributed.py reads it where no process group is live yet."""
from __future__ import annotations

import os
from typing import NamedTuple


class Launch(NamedTuple):
    world_size: int
    rank: int

    @property
    def is_main(self) -> bool:
        """The rank that shows progress, writes files and says what is wrong with the job's arguments."""
        return self.rank == 0


def launched() -> Launch:
    """The launcher's WORLD_SIZE and RANK; one process of rank 0 without them."""
    return Launch(int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0")))
