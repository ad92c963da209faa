"""Symmetric memory with a lifetime (sp/fabric.py): a fabric's workspace grows to the largest call's need, not the
sum over the sizes it saw; it cannot grow inside a CUDA-graph capture (it says what to do instead); a growth hands
out new buffers; `disable` gives every fabric's memory back and a later `enable` opens a fresh one; the service's
/metrics says what rank 0 holds. On CPU the workspace runs over a loopback fabric (the production carve and store
kernels, in Triton's interpreter) and the processes' fabrics are stand-ins of the same workspace; a GPU serves 30
sizes through the real service over symmetric memory."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import xstage_dit
from dist_harness import run_on_ranks
from xstage_dit import api
from xstage_dit.runtime.distributed import free_port
from xstage_dit.sp import fabric as fabrics
from xstage_dit.sp.fabric import (LoopbackFabric, Need, View, Workspace, gather_steps, memory_epoch, run_in_lockstep,
                                  symmetric_bytes_held)

REPOSITORY = Path(__file__).resolve().parents[1]
ROW_COUNTS = random.Random(0).sample(range(1, 61), 30)  # 30 distinct sizes, in no order


def test_the_workspace_holds_the_largest_need_not_the_sum():
    """30 gathers of distinct sizes (the production steps and store kernel, two simulated ranks): each is right,
    and the workspace holds the largest one's need, grown only when a call needed more than every earlier one."""
    fabric = LoopbackFabric(2, "cpu", initialise=lambda t: t.fill_(float("nan")))
    needs, growths = [], 0
    for rows in ROW_COUNTS:
        parts = [torch.randn(rows, 8) for _ in range(2)]
        needs.append(Need.of([View("rows", (2 * rows, 8), torch.float32)]).total)
        growths += needs[-1] > max(needs[:-1], default=0)
        outs = run_in_lockstep([gather_steps(part, fabric.rank(r), "rows") for r, part in enumerate(parts)],
                               fabric.rank(0).barrier)
        assert all(torch.equal(out, torch.cat(parts)) for out in outs), rows
    assert fabric.workspace.nbytes == max(needs) < sum(needs)
    assert fabric.workspace.generation == growths
    assert all(t.numel() == max(needs) for t in fabric.workspace.allocation.tensors.values())


FUSED = [View("q", (2, 96, 2, 64), torch.bfloat16), View("k", (2, 128, 2, 64), torch.bfloat16),
         View("v", (2, 128, 2, 64), torch.bfloat16), View("out", (2, 48, 4, 64), torch.bfloat16, kept=True)]
EXPERTS = [View("experts-received", (300, 64), torch.float32), View("experts-combine", (600, 64), torch.float32,
                                                                    kept=True)]
RING = [View("ring_kv", (2, 40000), torch.bfloat16)]


def _spans(fabric: LoopbackFabric, views: list[View]) -> dict[str, tuple[int, int]]:
    base = fabric.workspace.allocation.tensors[0].data_ptr()
    carved = fabric.rank(0).carve(views)
    return {view.name: (carved[view.name].tensor.data_ptr() - base,
                        carved[view.name].tensor.data_ptr() - base + view.nbytes) for view in views}


def test_views_kept_past_a_call_share_no_byte_with_any_calls_front_views():
    """The fused attention's output and the expert combine (read after their call's last barrier) lie where no
    call's views that peers store into before its first barrier lie; each call's views are aligned and disjoint."""
    fabric = LoopbackFabric(2, "cpu")
    for views in (FUSED, EXPERTS, RING):
        fabric.workspace.reserve(views)
    spans = {kind: _spans(fabric, views) for kind, views in (("fused", FUSED), ("experts", EXPERTS), ("ring", RING))}
    kept = [span for kind, views in (("fused", FUSED), ("experts", EXPERTS)) for view in views if view.kept
            for span in [spans[kind][view.name]]]
    front = [span for kind, views in (("fused", FUSED), ("experts", EXPERTS), ("ring", RING)) for view in views
             if not view.kept for span in [spans[kind][view.name]]]
    assert all(k_end <= f_start or f_end <= k_start for k_start, k_end in kept for f_start, f_end in front)
    for call in spans.values():
        ordered = sorted(call.values())
        assert all(start % fabrics.ALIGNMENT_BYTES == 0 for start, _ in ordered)
        assert all(end <= start for (_, end), (start, _) in zip(ordered, ordered[1:]))
    assert max(end for call in spans.values() for _, end in call.values()) <= fabric.workspace.nbytes
    assert fabric.workspace.nbytes == Need.of(FUSED).union(Need.of(EXPERTS)).union(Need.of(RING)).total


def test_a_growth_during_a_capture_is_refused_in_words(monkeypatch):
    """Inside a (simulated) CUDA-graph capture a call that fits is carved as before; one that needs more raises,
    naming the bytes and the largest view and saying what to do, and leaves the workspace as it was."""
    fabric = LoopbackFabric(2, "cpu")
    small = [View("rows", (64, 8), torch.float32)]
    fitted = fabric.rank(0).carve(small)["rows"].tensor.data_ptr()
    held, generation = fabric.workspace.nbytes, fabric.workspace.generation
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert fabrics.capturing()
    assert fabric.rank(1).carve(small)["rows"].tensor.data_ptr() != fitted  # rank 1's own, no growth
    big = [View("rows", (64, 8), torch.float32), View("scores", (4096, 8), torch.float32)]
    need = Need.of(big).total
    with pytest.raises(RuntimeError, match=rf"cannot grow while a CUDA graph is being captured: a call of rows, "
                                           rf"scores needs {need} bytes \('scores' 131072 of them\), it holds "
                                           rf"{held}\. Run one call at the largest size before capturing"):
        fabric.rank(0).carve(big)
    assert (fabric.workspace.nbytes, fabric.workspace.generation) == (held, generation)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    fabric.workspace.reserve(big)  # before the capture: then the capture's call fits
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert fabric.rank(0).carve(big)["scores"].tensor.shape == (4096, 8)


def test_a_call_warmed_up_before_a_growth_is_carved_in_a_capture_without_copies_from_the_host(monkeypatch):
    """A signature warmed up, then another call grew the workspace, then the first is captured: its carve inside
    the capture finds its destination tables (made at the growth), copying nothing from the host."""
    fabric = LoopbackFabric(2, "cpu")
    warmed = [View("rows", (64, 8), torch.float32)]
    fabric.rank(0).carve(warmed)
    fabric.rank(0).carve([View("rows", (4096, 8), torch.float32), View("half", (64, 8), torch.bfloat16)])

    def no_host_copy(*args):
        raise AssertionError("a destination table made inside a capture")

    monkeypatch.setattr(fabrics, "capturing", lambda: True)
    monkeypatch.setattr(fabrics, "offset_table", no_host_copy)
    for rank in range(2):
        buffer = fabric.rank(rank).carve(warmed)["rows"]
        assert buffer.tensor.data_ptr() == fabric.workspace.allocation.tensors[rank].data_ptr()


def test_a_growth_hands_out_new_buffers_and_moves_the_memory_epoch():
    """Buffers carved before a growth are not handed out after it: the same call is carved anew in the new
    allocation, and the epoch a CUDA graph is replayed at moves on (runtime/cuda_graphs.py drops older graphs)."""
    fabric = LoopbackFabric(2, "cpu")
    small = [View("rows", (64, 8), torch.float32)]
    before, epoch = fabric.rank(0).carve(small)["rows"], memory_epoch()
    assert fabric.rank(0).carve(small)["rows"] is before  # no growth: the same buffer
    fabric.rank(0).carve([View("rows", (4096, 8), torch.float32)])
    after = fabric.rank(0).carve(small)["rows"]
    assert after is not before and after.tensor.data_ptr() == fabric.workspace.allocation.tensors[0].data_ptr()
    assert memory_epoch() == epoch + 1 and fabric.workspace.generation == 2


def test_a_workspace_given_back_holds_nothing():
    workspace = Workspace(LoopbackFabric(2, "cpu")._allocate, "a test workspace")
    workspace.reserve([View("rows", (64, 8), torch.float32)])
    assert workspace.nbytes == 2048
    workspace.give_back()
    assert workspace.nbytes == 0 and workspace.allocation is None


class _StandInFabric:
    """A SymmetricFabric's place where there is no GPU: the same workspace, over this process's memory alone."""

    closed: list["_StandInFabric"] = []

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout_s: float) -> None:
        self.heap = SimpleNamespace(group=group, backend="stand-in")
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.holders: set = set()
        self.workspace = Workspace(LoopbackFabric(1, "cpu")._allocate, "a stand-in fabric")

    def close(self) -> None:
        self.workspace.give_back()
        _StandInFabric.closed.append(self)


def _enabled_models_hold_the_fabric_and_disable_gives_it_back() -> None:
    import diffusers
    from xstage_dit.testing import zoo

    dist.init_process_group("gloo")
    fabrics.SymmetricFabric = _StandInFabric  # this worker's process only
    api.needs_fabric = lambda choice, device, ring=False: True  # as where the fused backend may run
    first, second = (diffusers.FluxTransformer2DModel(**zoo.ZOO["tiny-flux"].transformer) for _ in range(2))
    xstage_dit.enable(first, backend="reference", timeout_s=60)
    (name,) = fabrics._FABRICS
    opened = fabrics.fabric_of(name)
    opened.workspace.reserve([View("rows", (64, 8), torch.float32)])  # what a call would have grown
    xstage_dit.enable(second, backend="reference", timeout_s=60)
    assert fabrics.fabric_of(name) is opened and len(opened.holders) == 2 and symmetric_bytes_held() == 2048
    xstage_dit.disable(first)
    assert fabrics.fabric_of(name) is opened and not _StandInFabric.closed  # the second pipeline still holds it
    xstage_dit.disable(second)
    assert fabrics._FABRICS == {} and _StandInFabric.closed == [opened] and symmetric_bytes_held() == 0
    assert opened.workspace.allocation is None
    xstage_dit.enable(first, backend="reference", timeout_s=60)  # the job's groups made anew, a fresh fabric
    (fresh,) = fabrics._FABRICS.values()
    assert fresh is not opened and fresh.workspace.nbytes == 0
    xstage_dit.disable(first)
    assert fabrics._FABRICS == {}


def test_disable_gives_every_fabrics_memory_back_and_enable_opens_a_fresh_one():
    """Two ranks: two enabled transformers hold the Ulysses group's fabric; it stays while either is enabled and
    is closed (its workspace given back, the registry empty) when the last is disabled; `enable` opens a new one."""
    run_on_ranks(2, _enabled_models_hold_the_fabric_and_disable_gives_it_back)


def _a_destroyed_groups_fabric_is_replaced() -> None:
    fabrics.SymmetricFabric = _StandInFabric
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    old = fabrics.open_fabric(dist.group.WORLD, torch.device("cpu"), 60)
    assert fabrics.open_fabric(dist.group.WORLD, torch.device("cpu"), 60) is old
    fabrics.release_fabrics(12345)  # opened without holders: no model's release closes it
    assert fabrics.fabric_of(old.heap.group.group_name) is old and not _StandInFabric.closed
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    assert dist.group.WORLD.group_name == old.heap.group.group_name  # the name comes back
    new = fabrics.open_fabric(dist.group.WORLD, torch.device("cpu"), 60)
    assert new is not old and _StandInFabric.closed == [old]
    fabrics.close_fabrics()
    assert fabrics._FABRICS == {} and _StandInFabric.closed == [old, new]


def test_a_fabric_of_a_destroyed_group_is_closed_not_reused():
    """A fabric opened without holders stays until `close_fabrics`; after the process group's teardown a new
    group may take the old one's name: its fabric is a fresh one, the old one closed."""
    run_on_ranks(1, _a_destroyed_groups_fabric_is_replaced)


def test_the_services_metrics_say_the_symmetric_memory_held(monkeypatch):
    pytest.importorskip("prometheus_client", reason="the service's metrics need the `serve` extra")
    from xstage_dit.serve.metrics import ServiceMetrics

    def gauge() -> float:
        line = next(line for line in ServiceMetrics().render().decode().splitlines()
                    if line.startswith("xstage_symmetric_memory_bytes "))
        return float(line.split()[1])

    monkeypatch.setattr(fabrics, "_FABRICS", {})
    assert gauge() == 0
    held = SimpleNamespace(workspace=Workspace(LoopbackFabric(1, "cpu")._allocate, "a test workspace"))
    held.workspace.reserve([View("rows", (100, 8), torch.float32)])
    monkeypatch.setitem(fabrics._FABRICS, "group", held)
    assert gauge() == held.workspace.nbytes == 3584


def _metric(url: str, name: str) -> float:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return float(next(line for line in text.splitlines() if line.startswith(name + " ")).split()[1])


@pytest.mark.gpu
def test_thirty_sizes_through_the_service_hold_the_largest_requests_need(tmp_path):
    """The real service (torchrun, two ranks sharing GPU 0, the fused backend over symmetric memory) answers 30
    distinct sizes: the memory held never shrinks, stops growing at the largest request, and equals what a fresh
    service holds after that request alone."""
    httpx = pytest.importorskip("httpx", reason="the service tests need the `serve` extra")
    sizes = [(16 * (2 + i % 6), 16 * (2 + i // 6)) for i in range(30)]  # widths x heights, 32..112 x 32..96
    largest = max(sizes, key=lambda size: size[0] * size[1])
    random.Random(1).shuffle(sizes)

    def serve(log: Path, asked: list[tuple[int, int]]) -> list[float]:
        port = free_port()
        environment = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "OMP_NUM_THREADS": "1",
                       "CUDA_VISIBLE_DEVICES": "0", "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1",
                       "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0",
                   "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "xstage_dit.serve",
                   "--config", "tiny-flux-d64", "--backend", "fused", "--port", str(port), "--timeout-s", "60"]
        process = subprocess.Popen(command, env=environment, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                   start_new_session=True)
        url, held = f"http://127.0.0.1:{port}", []
        try:
            deadline = time.monotonic() + 240
            while True:
                assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
                try:
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.5)
            for width, height in asked:
                answer = httpx.post(f"{url}/v1/images/generations", timeout=120,
                                    json={"prompt": "a lighthouse", "size": f"{width}x{height}",
                                          "num_inference_steps": 2})
                assert answer.status_code == 200, answer.text
                held.append(_metric(url, "xstage_symmetric_memory_bytes"))
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=60)
        return held

    held = serve(tmp_path / "thirty.log", sizes)
    assert held[0] > 0 and all(a <= b for a, b in zip(held, held[1:])), held
    assert set(held[sizes.index(largest):]) == {held[-1]}, held
    assert serve(tmp_path / "largest.log", [largest]) == [held[-1]]


@pytest.mark.gpu
def test_a_graph_captured_before_a_growth_is_dropped_and_captured_again():
    """A CUDA graph is replayed only at the memory epoch of its capture: after a workspace growth its signature
    warms up and is captured again instead of replaying addresses given back."""
    from xstage_dit.runtime.cuda_graphs import EAGER_CALLS, CrossRankWork, SignatureGraphs

    epoch = [0]
    graphs = SignatureGraphs("double", lambda x: x * 2, torch.device("cuda"),
                             CrossRankWork(0, "no peers", 60, memory_epoch=lambda: epoch[0]))
    x = torch.ones(4, device="cuda")
    with torch.no_grad():
        for _ in range(EAGER_CALLS + 2):  # warm-ups, the capture, a replay
            graphs(x)
        assert graphs.captured == 1 and graphs.use.replays == 1
        epoch[0] += 1
        assert torch.equal(graphs(x), x * 2) and graphs.captured == 0 and graphs.use.replays == 1
        for _ in range(EAGER_CALLS):
            graphs(x)
        assert graphs.captured == 1 and torch.equal(graphs(x), x * 2) and graphs.use.replays == 2
