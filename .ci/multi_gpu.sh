#!/usr/bin/env bash
# The multi-GPU run (issue 6), one script for one machine with G GPUs; results under $OUT, a timing line per part.
#   bash .ci/multi_gpu.sh            # on 2, 4 or 8 H200s: the real run (estimated 20-25 min on 8; never run)
#   DRY_RUN=1 bash .ci/multi_gpu.sh  # on one GPU: 2 processes share it, tiny models, short sweeps, no
#                                    # calibration (the committed same-GPU one plans); checks the scripts end to
#                                    # end, its timings mean nothing
# Parts: 1. parallel vs single-GPU results (reference, fused) at N = 2, 4, ..., G; 2. xstage-dit calibrate;
# 3. attention + post-all-to-all at N = G (attention only / serial / fused, planner predictions);
# 4. end to end at N = 1, 2, 4, 8 <= G: stock, xstage reference / fused / auto, diffusers' own Ulysses.
set -uo pipefail
if [ "${DRY_RUN:-0}" = 1 ]; then
  export XSTAGE_SKIP_CUDA_EXT=1 XSTAGE_CALIBRATION_DIR=$PWD/docs/benchmarks
fi
source .ci/device_setup.sh
G=$(nvidia-smi -L | wc -l)
if [ "${DRY_RUN:-0}" = 1 ]; then
  G=2; IMAGE=tiny-flux-d64; VIDEO=tiny-wan-d64; IMAGE_STEPS=2; VIDEO_STEPS=2; SHAPES="seq-8192 flux-1024"
  SIZE="--height 64 --width 64"  # token counts that diffusers' Ulysses can split in two
else
  IMAGE=flux-dev; VIDEO=wan-14b; IMAGE_STEPS=28; VIDEO_STEPS=2; SIZE=""
  SHAPES="seq-8192 seq-16384 seq-32768 seq-65536 flux-1024 wan14b-720p"
fi
RUN="python3 -m torch.distributed.run --standalone"
part() { echo "== $1 ($(date +%T))"; }

part "1. correctness"
for n in 2 4 8; do
  [ "$n" -le "$G" ] || continue
  checks=$([ "${DRY_RUN:-0}" = 1 ] && echo "$IMAGE $VIDEO" || echo "flux-dev wan-1.3b")
  # shellcheck disable=SC2086  # checks is a list of configs
  if ! $RUN --nproc_per_node "$n" "$REPO/examples/check_parallel.py" --config $checks --backend reference fused \
      --out "$OUT/correctness-n$n" 2>&1 | tail -8; then
    # the NVSHMEM symmetric-memory backend has never run before this machine: if it fails, say so, and let the
    # rest of the run use the CUDA backend (same kernels, peer memory mapped through CUDA IPC)
    echo "!! N=$n failed (backend ${XSTAGE_SYMM_MEM_BACKEND:-auto}); retrying with XSTAGE_SYMM_MEM_BACKEND=CUDA"
    export XSTAGE_SYMM_MEM_BACKEND=CUDA
    # shellcheck disable=SC2086
    $RUN --nproc_per_node "$n" "$REPO/examples/check_parallel.py" --config $checks --backend reference fused \
      --out "$OUT/correctness-n$n-cuda-backend" 2>&1 | tail -8
  fi
done

part "2. calibration"
[ "${DRY_RUN:-0}" = 1 ] || python3 -m xstage_dit.cli calibrate --out "$XSTAGE_CALIBRATION_DIR" 2>&1 | tail -4

part "3. kernel sweep at N=$G"
$RUN --nproc_per_node "$G" "$REPO/examples/bench_dist_kernels.py" --shapes $SHAPES \
  --out "$OUT/dist-kernels-n$G" 2>&1 | tail -12

part "4. end to end"
for n in 1 2 4 8; do
  [ "$n" -le "$G" ] || continue
  # shellcheck disable=SC2086  # SIZE is a list of arguments
  $RUN --nproc_per_node "$n" "$REPO/examples/bench_e2e.py" --config "$IMAGE" $SIZE --steps "$IMAGE_STEPS" --repeats 1 \
    --backend reference fused auto --diffusers-cp --out "$OUT/e2e-multi" 2>&1 | grep -v Warning | tail -6
  # shellcheck disable=SC2086
  $RUN --nproc_per_node "$n" "$REPO/examples/bench_e2e.py" --config "$VIDEO" $SIZE --steps "$VIDEO_STEPS" --repeats 1 \
    --backend reference fused auto --diffusers-cp --out "$OUT/e2e-multi" 2>&1 | grep -v Warning | tail -6
done
part "done"
