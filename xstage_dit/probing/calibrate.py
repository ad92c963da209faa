"""`xstage-dit calibrate`: measure this machine's store path with the csrc/ probes, fit the Burst-Gap model, measure
the kernel costs the planner needs, and write one calibration JSON per store path.

One GPU: "loopback" (the producers store into a local buffer in this process) and "same-gpu" (two processes on
the GPU, rank 0 storing into rank 1's symmetric buffer through its CUDA IPC mapping). Several GPUs: "nvlink" or
"pcie" (rank 0 storing into rank 1's symmetric buffer on the next GPU; NCCL all-to-all rate measured too)."""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ..runtime.distributed import free_port
from ..burst_gap.calibration import Calibration, KernelCosts
from ..burst_gap.model import BurstGapModel
from .probes import BurstProbe, round_volume

KiB, MiB = 1024, 1024 * 1024
DESTINATION_BYTES = 512 * MiB  # bursts rotate through it: more than L2 holds
ISOLATED_REPEATS = 5
PEER_TIMEOUT_S = 600  # the idle ranks wait at a barrier while rank 0 sweeps: bounded, never a hang


def sweep_grid(sms: int, quick: bool) -> dict[str, tuple]:
    if quick:
        return {"producers": (4, sms), "volumes": (1 * MiB, 4 * MiB), "gaps": (0.0, 8e-6), "trains": (6,)}
    return {"producers": (1, 4, 16, 64, sms), "volumes": (256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB),
            "gaps": (0.0, 2e-6, 8e-6, 32e-6), "trains": (6, 24)}


def sweep(probe: BurstProbe, destination: torch.Tensor, sms: int, quick: bool) -> tuple[list[dict], list[dict]]:
    """BurstGapModel.fit records (isolated bursts and trains over K, V, G, length) and, separately, isolated
    bursts timed until their stores are visible (fence)."""
    grid = sweep_grid(sms, quick)
    samples, visibility = [], []
    for producers in grid["producers"]:
        for target in grid["volumes"]:
            volume = round_volume(target, producers)
            probe.train(destination, producers, volume, 2, 0.0)  # warm-up
            isolated = [probe.train(destination, producers, volume, 1, 0.0).issue_times[0]
                        for _ in range(ISOLATED_REPEATS)]
            samples.append({"producers": producers, "volume": volume, "gap": 0.0, "bursts": 1,
                            "issue_time": statistics.median(isolated)})
            visible = [probe.train(destination, producers, volume, 1, 0.0, fence=True).issue_times[0]
                       for _ in range(ISOLATED_REPEATS)]
            visibility.append({"producers": producers, "volume": volume, "issue_time": statistics.median(isolated),
                               "visible_time": statistics.median(visible)})
            for gap in grid["gaps"]:
                for length in grid["trains"]:
                    train = probe.train(destination, producers, volume, length, gap)
                    samples.append({"producers": producers, "volume": volume, "gap": train.steady_gap(),
                                    "requested_gap": gap, "bursts": length, "issue_time": train.steady_issue_time()})
    return samples, visibility


def fit(samples: list[dict]) -> tuple[BurstGapModel, dict[str, float]]:
    model = BurstGapModel.fit(samples)
    errors = sorted(abs(model.predict(s["producers"], s["volume"], s["gap"], s["bursts"]) / s["issue_time"] - 1)
                    for s in samples)
    return model, {"median": statistics.median(errors), "max": errors[-1], "samples": len(errors)}


def _median_seconds(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e-3


# heads of the attention-rate samples: enough that the shortest (4096 tokens) runs longer than a launch's host
# time plus do_bench's cache flush, so that the rate measures the GPU, not the host
# (docs/benchmarks/calibration-h200.md)
RATE_HEADS = 24


def measure_kernel_costs(device: torch.device, alltoall_rate: float | None = None) -> KernelCosts:
    """Attention throughput of our kernel and cuDNN SDPA (bf16, RATE_HEADS heads) at a few lengths per head_dim,
    the device-to-device copy rate, and one small kernel's cost. alltoall_rate defaults to the copy rate (one GPU:
    an all-to-all among simulated ranks is a local copy)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ..kernels.attention import flash_attention

    own: dict[int, list] = {}
    vendor: dict[int, list] = {}
    for head_dim in (64, 128):
        for tokens in (4096, 16384, 65536):
            q, k, v = (torch.randn(1, tokens, RATE_HEADS, head_dim, device=device, dtype=torch.bfloat16)
                       for _ in range(3))
            flops = 4.0 * RATE_HEADS * tokens * tokens * head_dim
            mine = _median_seconds(lambda: flash_attention(q, k, v))
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                theirs = _median_seconds(lambda: F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)))
            own.setdefault(head_dim, []).append((tokens, flops / mine / 1e12))
            vendor.setdefault(head_dim, []).append((tokens, flops / theirs / 1e12))
    src = torch.empty(256 * MiB, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_rate = src.numel() / _median_seconds(lambda: dst.copy_(src))
    tiny = torch.zeros(1, device=device)
    launch = _median_seconds(lambda: tiny.add_(1))
    return KernelCosts(own, vendor, copy_rate, alltoall_rate or copy_rate, launch, _sms(device),
                       measure_expert_rates(device))


# the experts timed: NucleusMoE-Image's (dim 2048, width 1344), the 32 a rank owns at two ranks
EXPERTS, EXPERT_DIM, EXPERT_WIDTH = 32, 2048, 1344
EXPERT_ROWS = (64, 128, 256, 512, 1024, 2048)


def measure_expert_rates(device: torch.device) -> dict[str, list[tuple[int, float]]]:
    """SwiGLU-expert throughput (both projections, bf16) by rows per expert: our expert kernel in one wave, its
    combine rows stored locally ("own"), and torch's grouped matmuls ("vendor")."""
    from ..kernels.experts import Combine, ExpertOperands, run_experts
    from ..sp.moe.grouped import packed_swiglu_experts
    from ..burst_gap.moe_plan import ExpertSchedule

    options = {"device": device, "dtype": torch.bfloat16}
    gate_up = torch.randn(EXPERTS, EXPERT_DIM, 2 * EXPERT_WIDTH, **options) * EXPERT_DIM ** -0.5
    down = torch.randn(EXPERTS, EXPERT_WIDTH, EXPERT_DIM, **options) * EXPERT_WIDTH ** -0.5
    launches = ExpertSchedule().launches(EXPERTS)
    rates: dict[str, list[tuple[int, float]]] = {"own": [], "vendor": []}
    for rows in EXPERT_ROWS:
        slots = EXPERTS * rows
        x = torch.randn(slots, EXPERT_DIM, **options)
        counts = torch.full((EXPERTS,), rows, dtype=torch.int64, device=device)
        operands = ExpertOperands(received=x, gate_up=gate_up, down=down, act=x.new_empty(slots, EXPERT_WIDTH),
                                  combine=Combine.local(torch.empty_like(x)))
        flops = 6.0 * slots * EXPERT_DIM * EXPERT_WIDTH
        own = _median_seconds(lambda: [run_experts(operands, up, down_, False) for up, down_ in launches])
        vendor = _median_seconds(lambda: packed_swiglu_experts(gate_up, down, x, counts))
        rates["own"].append((rows, flops / own / 1e12))
        rates["vendor"].append((rows, flops / vendor / 1e12))
    return rates


def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _meta() -> dict:
    import triton

    return {"date": datetime.date.today().isoformat(), "command": " ".join(["xstage-dit", *sys.argv[1:]]),
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__}


def calibrate_loopback(quick: bool) -> Calibration:
    device = torch.device("cuda", torch.cuda.current_device())
    probe = BurstProbe(device)
    destination = torch.empty(DESTINATION_BYTES, dtype=torch.uint8, device=device)
    samples, visibility = sweep(probe, destination, _sms(device), quick)
    model, error = fit(samples)
    return Calibration(torch.cuda.get_device_name(device), "loopback", 1, model, measure_kernel_costs(device), error,
                       samples, visibility, _meta())


def _peer_worker(rank: int, world_size: int, port: int, same_gpu: bool, quick: bool, result: str) -> None:
    """Rank 0 probes the store path into rank 1's symmetric buffer; the others hold theirs and wait."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if same_gpu:
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    device = torch.device("cuda", 0 if same_gpu else rank)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo" if same_gpu else "nccl", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=PEER_TIMEOUT_S),
                            **({} if same_gpu else {"device_id": device}))
    try:
        buffer = symm_mem.empty(DESTINATION_BYTES, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(buffer, dist.group.WORLD.group_name)
        alltoall_rate = None if same_gpu else _alltoall_rate(device)
        if rank == 0:
            peer = handle.get_buffer(1, (DESTINATION_BYTES,), torch.uint8)
            samples, visibility = sweep(BurstProbe(device), peer, _sms(device), quick)
            Path(result).write_text(json.dumps({"samples": samples, "visibility": visibility,
                                                "alltoall_rate": alltoall_rate}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _alltoall_rate(device: torch.device) -> float:
    """Send-buffer bytes per second of NCCL all_to_all_single over the world (64 MiB per rank)."""
    import torch.distributed as dist

    send = torch.empty(64 * MiB // 2, dtype=torch.bfloat16, device=device)
    recv = torch.empty_like(send)
    for _ in range(3):
        dist.all_to_all_single(recv, send)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dist.all_to_all_single(recv, send)
    end.record()
    end.synchronize()
    return 64 * MiB * 10 / (start.elapsed_time(end) * 1e-3)


def topology_matrix() -> str:
    """The GPU interconnect matrix, as `nvidia-smi topo -m` prints it."""
    if not shutil.which("nvidia-smi"):
        return "nvidia-smi not found"
    result = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
    return result.stdout.strip() or result.stderr.strip()


def topology() -> str:
    """The store path between GPU 0 and GPU 1 (NVLink when nvidia-smi's matrix says NV#)."""
    gpu0 = next((line.split() for line in topology_matrix().splitlines() if line.startswith("GPU0")), [])
    return "nvlink" if len(gpu0) > 2 and gpu0[2].startswith("NV") else "pcie"


def calibrate_peers(quick: bool) -> Calibration:
    """Several processes: on one GPU (two ranks sharing it) or one per GPU."""
    import torch.multiprocessing as mp

    gpus = torch.cuda.device_count()
    same_gpu = gpus == 1
    world_size = 2 if same_gpu else gpus
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        mp.start_processes(_peer_worker, args=(world_size, free_port(), same_gpu, quick, result),
                           nprocs=world_size, start_method="spawn")
        measured = json.loads(Path(result).read_text())
    model, error = fit(measured["samples"])
    device = torch.device("cuda", 0)
    costs = measure_kernel_costs(device, measured["alltoall_rate"])
    return Calibration(torch.cuda.get_device_name(device), "same-gpu" if same_gpu else topology(), world_size,
                       model, costs, error, measured["samples"], measured["visibility"], _meta())


def describe(calibration: Calibration) -> str:
    m, e = calibration.model, calibration.fit_error
    return (f"{calibration.gpu} {calibration.topology} n={calibration.world_size}: "
            f"t0 {m.issue_latency * 1e6:.2f} us, b {m.producer_rate / 1e9:.1f} GB/s per producer, "
            f"Bmax {m.max_issue_rate / 1e9:.0f} GB/s, R {m.drain_rate / 1e9:.0f} GB/s, "
            f"Q {m.capacity / MiB:.2f} MiB; fit error median {e['median']:.1%}, max {e['max']:.1%} "
            f"over {e['samples']} samples")


def remeasure_kernel_costs(paths: list[Path], out: Path) -> list[Path]:
    """After a kernel changed: measure the kernel-cost table again and write it into existing calibrations of
    this GPU, keeping their Burst-Gap fit and all-to-all rate (no probes, no peers). meta["kernel_costs"] says
    when and how the table was measured."""
    if not torch.cuda.is_available():
        raise RuntimeError("xstage-dit calibrate needs a CUDA GPU")
    calibrations = [Calibration.load(path) for path in paths]
    card = torch.cuda.get_device_name()
    for path, calibration in zip(paths, calibrations):
        if calibration.gpu != card:
            raise ValueError(f"{path} calibrates {calibration.gpu}, this GPU is {card}")
    fresh = measure_kernel_costs(torch.device("cuda", torch.cuda.current_device()))
    saved = []
    for calibration in calibrations:
        calibration.costs = dataclasses.replace(fresh, alltoall_rate=calibration.costs.alltoall_rate)
        calibration.meta = {**calibration.meta, "kernel_costs": _meta()}
        saved.append(calibration.save(out))
        print(describe(calibration), "->", saved[-1])
    return saved


def calibrate(out: Path, quick: bool = False) -> list[Path]:
    """Run every store path this machine has, write the calibrations to `out`, print the fitted parameters."""
    if not torch.cuda.is_available():
        raise RuntimeError("xstage-dit calibrate needs a CUDA GPU (it times stores issued by GPU kernels)")
    paths = []
    for run in (calibrate_loopback, calibrate_peers):
        calibration = run(quick)
        paths.append(calibration.save(out))
        print(describe(calibration), "->", paths[-1])
    return paths
