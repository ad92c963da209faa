"""A job of tests/test_ring.py's two pretend nodes (two torchrun agents on this machine, c10d rendezvous): the tiny
Flux pipeline, enabled with no degrees given, splits each sequence as Ulysses inside a node and a ring across the
nodes, and equals one process."""
import torch

import xstage_dit
from xstage_dit.runtime.distributed import build_groups
from xstage_dit.testing import zoo


def main() -> None:
    pipe = zoo.build_pipeline("tiny-flux")
    pipe.set_progress_bar_config(disable=True)
    kwargs = zoo.call_kwargs("tiny-flux", height=20, width=28, num_frames=1, steps=2, guidance=1.0)

    def generate() -> torch.Tensor:
        return pipe(**kwargs, **zoo.text_embeddings("tiny-flux", 1, seed=1), output_type="latent",
                    generator=torch.Generator().manual_seed(3), return_dict=False)[0]

    stock = generate()
    xstage_dit.enable(pipe, backend="reference", timeout_s=60)
    config = pipe.transformer._xstage_dit_applied.config
    out = generate()
    error = ((out - stock).norm() / stock.norm()).item()
    assert (config.ulysses_degree, config.ring_degree) == (2, 2), config
    groups = build_groups(1, 2, 60, 2)  # the groups enable made (one mesh per job and split)
    assert groups.ulysses_within_node and not groups.ring_within_node  # the fused paths stay off the network
    assert error < 1e-4, f"relative error {error:.2e}"
    if xstage_dit.is_main_process():
        print(f"two nodes: ulysses {config.ulysses_degree} x ring {config.ring_degree}, relative error {error:.1e}")
    xstage_dit.disable(pipe)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
