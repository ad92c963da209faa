"""What the library keeps in the process besides an enabled model: the job's placement (whether ranks share GPUs),
decided from the launcher's facts and never from an environment variable the library sets itself, and the
planners, emptied by `disable`; the groups and meshes, kept per default group (enable and disable again make no
new ones); the warnings said once, and the API tests use to hear them again."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import xstage_dit
from dist_harness import run_on_ranks
from xstage_dit.logging_utils import fresh_warnings, warn_once, warnings_seen
from xstage_dit.runtime import distributed
from xstage_dit.runtime.distributed import Placement, ensure_process_group, forget_groups, job_placement
from xstage_dit.sp import planner
from xstage_dit.sp.attention import routing
from xstage_dit.testing import zoo
from xstage_dit.vae import layers as vae_layers

OVERLAPPING = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"


@pytest.fixture
def placement_afresh():
    forget_groups()
    yield
    forget_groups()


@pytest.mark.parametrize("gpus, shared", [(0, False), (1, True), (2, False)])
def test_the_placement_is_the_launchers_facts_whatever_torchs_flag_says(placement_afresh, monkeypatch, gpus, shared):
    """Two ranks on this node: they share GPUs where fewer GPUs are seen, with or without torch's flag set."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.delenv(OVERLAPPING, raising=False)
    without = job_placement()
    forget_groups()
    monkeypatch.setenv(OVERLAPPING, "1")
    assert job_placement() == without == Placement(local_ranks=2, gpus=gpus)
    assert without.ranks_share_gpus == shared


def _placement_with_the_flag() -> None:
    os.environ[OVERLAPPING] = "1"  # the user's own reasons
    ensure_process_group(60.0)
    dist.barrier()  # rank 0 holds the group's store: it must not end before the other rank has joined
    placed = job_placement()
    forget_groups()
    del os.environ[OVERLAPPING]
    assert job_placement() == placed == Placement(2, torch.cuda.device_count())
    assert dist.get_backend() == ("gloo" if torch.cuda.device_count() in (0, 1) else "nccl")


def test_a_users_flag_on_a_gloo_job_leaves_the_placement_as_it_is():
    run_on_ranks(2, _placement_with_the_flag)


def _latents(pipe) -> torch.Tensor:
    kwargs = zoo.call_kwargs("tiny-flux", height=20, width=28, num_frames=1, steps=1, guidance=2.0)
    return pipe(**kwargs, **zoo.text_embeddings("tiny-flux", 1, seed=0), output_type="latent",
                generator=torch.Generator().manual_seed(0), return_dict=False)[0]


def _groups_made() -> int:
    return len(dist.distributed_c10d._world.pg_names)


def _disable_empties_the_caches_but_keeps_the_groups() -> None:
    pipe = zoo.build_pipeline("tiny-flux")
    pipe.set_progress_bar_config(disable=True)
    xstage_dit.enable(pipe)
    first = _latents(pipe)
    distributed.world_group(7.0)  # a group of another timeout than the default group's
    assert distributed._mesh_cache and distributed._world_groups and distributed._placement is not None
    xstage_dit.disable(pipe)
    assert distributed._placement is None and not planner._planners
    assert routing._active is None and not routing._rotating and vae_layers._active is None
    groups = _groups_made()
    for _ in range(3):  # the same groups again: none made anew
        xstage_dit.enable(pipe)
        assert torch.equal(_latents(pipe), first)
        distributed.world_group(7.0)
        xstage_dit.disable(pipe)
        assert _groups_made() == groups


def test_disable_empties_the_caches_and_enable_and_disable_again_make_no_new_groups():
    run_on_ranks(2, _disable_empties_the_caches_but_keeps_the_groups)


def _a_new_default_group_finds_none_of_the_old_ones(store_path: str) -> None:
    ensure_process_group(60.0)
    rank = dist.get_rank()
    before = distributed.world_group(7.0), distributed.timed_mesh((1, 1, 2), 7.0)
    assert distributed.world_group(7.0) is before[0] and distributed.timed_mesh((1, 1, 2), 7.0) is before[1]
    dist.destroy_process_group()  # the user's teardown, without disable
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    after = distributed.world_group(7.0), distributed.timed_mesh((1, 1, 2), 7.0)
    assert after[0] is not before[0] and after[1] is not before[1]
    assert dist.get_world_size(after[0]) == 2 and after[1].mesh.size() == 2


def test_groups_are_kept_per_default_group(tmp_path):
    run_on_ranks(2, _a_new_default_group_finds_none_of_the_old_ones, str(tmp_path / "store"))


def test_warn_once_says_a_message_once_and_fresh_warnings_says_it_again(caplog):
    said_before = "xstage_dit: a warning said before the block"
    inside = "xstage_dit: a warning said inside the block"
    with fresh_warnings():  # the outer block leaves the process's warnings as they were
        warn_once(said_before)
        caplog.clear()
        with fresh_warnings():
            assert said_before not in warnings_seen()
            for _ in range(2):
                warn_once(inside)
                warn_once(said_before)
            assert {inside, said_before} <= warnings_seen()
        warn_once(said_before)
        assert [r.getMessage() for r in caplog.records] == [inside, said_before]
        assert said_before in warnings_seen() and inside not in warnings_seen()
    assert said_before not in warnings_seen()
