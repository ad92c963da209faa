#!/usr/bin/env bash
# The multi-GPU run on one machine with G GPUs; results under $OUT, a timing line per part. A device call
# may run 10 minutes, so the run is split into parts, each a quoted argument, run in the order given:
#   "correctness"      parallel vs single-GPU results, reference and fused, N = 2, 4, ..., G (Flux 1024², Wan 1.3B 480p)
#   "calibrate"        xstage-dit calibrate (loopback, and rank 0 -> rank 1 over the real link); builds csrc/
#   "kernels"          attention + post-all-to-all at N = G: attention only / serial / fused, planner predictions
#   "e2e CONFIG N..."  bench_e2e at each N: stock (N = 1), xstage reference / fused / auto, diffusers' own Ulysses,
#                      and rank 0's GPU time per step by kernel (--profile): wall minus GPU time says how host-bound
# On 8 GPUs, four calls, each within one device call (docs/benchmarks/notes-multi-gpu-device-time.md has the times):
#   bash .ci/multi_gpu.sh correctness
#   bash .ci/multi_gpu.sh calibrate kernels
#   bash .ci/multi_gpu.sh "e2e flux-dev 1 2 4 8"
#   bash .ci/multi_gpu.sh "e2e wan-14b 2 4 8" "e2e wan-14b 1"
# Every call starts a fresh machine: commit the calibration JSON the second call writes under
# xstage_dit/calibrations (shipped with the package, where `auto` finds it on every machine of that GPU kind).
# DRY_RUN=1 (one GPU): 2 processes share it, tiny models, short sweeps, no calibration (the shipped same-GPU
# one plans); it checks the scripts end to end, its timings mean nothing:
#   DRY_RUN=1 bash .ci/multi_gpu.sh correctness kernels "e2e tiny-flux-d64 1 2" "e2e tiny-wan-d64 1 2"
set -uo pipefail
case " $* " in *" calibrate "*) ;; *) export XSTAGE_SKIP_CUDA_EXT=1 ;; esac  # only calibrate needs csrc/
source .ci/device_setup.sh
G=$(nvidia-smi -L | wc -l)
if [ "${DRY_RUN:-0}" = 1 ]; then
  G=2; CHECKS="tiny-flux-d64 tiny-wan-d64"; SHAPES="seq-8192 flux-1024"; STEPS=2
  SIZE="--height 64 --width 64"  # token counts that diffusers' Ulysses can split in two
else
  CHECKS="flux-dev wan-1.3b"; SHAPES="seq-8192 seq-16384 seq-32768 seq-65536 flux-1024 wan14b-720p"; SIZE=""
fi
RUN="python3 -m torch.distributed.run --standalone"
part() { echo "== $1 ($(date +%T))"; }

correctness() {
  for n in 2 4 8; do
    [ "$n" -le "$G" ] || continue
    # shellcheck disable=SC2086  # CHECKS is a list of configs
    if ! $RUN --nproc_per_node "$n" "$REPO/examples/check_parallel.py" --config $CHECKS --backend reference fused \
        --out "$OUT/correctness-n$n" 2>&1 | tail -8; then
      # if the symmetric-memory backend chosen automatically (NVSHMEM where torch has it) fails, say so, and
      # let the rest of this call use the CUDA backend (same kernels, peer memory mapped through CUDA IPC)
      echo "!! N=$n failed (backend ${XSTAGE_SYMM_MEM_BACKEND:-auto}); retrying with XSTAGE_SYMM_MEM_BACKEND=CUDA"
      export XSTAGE_SYMM_MEM_BACKEND=CUDA
      # shellcheck disable=SC2086
      $RUN --nproc_per_node "$n" "$REPO/examples/check_parallel.py" --config $CHECKS --backend reference fused \
        --out "$OUT/correctness-n$n-cuda-backend" 2>&1 | tail -8
    fi
  done
}

e2e() {
  local config=$1; shift
  local steps=${STEPS:-$([ "$config" = flux-dev ] && echo 28 || echo 2)}
  for n in "$@"; do
    [ "$n" -le "$G" ] || continue
    # shellcheck disable=SC2086  # SIZE is a list of arguments
    $RUN --nproc_per_node "$n" "$REPO/examples/bench_e2e.py" --config "$config" $SIZE --steps "$steps" \
      --repeats 1 --backend reference fused auto --diffusers-cp --profile --out "$OUT/e2e-multi" 2>&1 \
      | grep -v Warning | tail -6
  done
}

for request in "$@"; do
  part "$request"
  # shellcheck disable=SC2086  # a request is a part name and its arguments
  set -- $request
  case "$1" in
    correctness) correctness ;;
    calibrate) python3 -m xstage_dit.cli calibrate --out "$XSTAGE_CALIBRATION_DIR" 2>&1 | tail -4 ;;
    # shellcheck disable=SC2086
    kernels) $RUN --nproc_per_node "$G" "$REPO/examples/bench_dist_kernels.py" --shapes $SHAPES \
               --out "$OUT/dist-kernels-n$G" 2>&1 | tail -12 ;;
    e2e) shift; e2e "$@" ;;
    *) echo "unknown part: $request"; exit 2 ;;
  esac
done
part "done"
