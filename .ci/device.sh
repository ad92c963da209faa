#!/usr/bin/env bash
# The GPU checks of the project, for the device machine (one H200): install, GPU tests, end-to-end benchmarks.
# Run from the repository root with .whl carried (../shared/device/wheels.sh fetches it). Results go to $OUT.
#   bash .ci/device.sh [tests] [calibrate] [kernels] ["BENCH_E2E ARGS" ...]
# in the order given (no argument: tests): "tests" runs the GPU tests, "calibrate" `xstage-dit calibrate`
# into $XSTAGE_CALIBRATION_DIR (default $OUT/calibration, where the benchmarks and backend="auto" look),
# "kernels" examples/bench_kernels.py, every other argument is one quoted bench_e2e.py argument list
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
REPO=$PWD; OUT=${OUT:-$REPO/out}; mkdir -p "$OUT"
export XSTAGE_CALIBRATION_DIR=${XSTAGE_CALIBRATION_DIR:-$OUT/calibration}
# offline machine: wheels from .whl, and the project built without build isolation (setuptools and torch come
# from the image; csrc/ is compiled here when it has sources)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1 || exit 1
if ! python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . > "$OUT/install.log" 2>&1; then
  # a broken csrc/ build must not cost the rest of the run: report it, install without the probes
  grep -E "error|Error" "$OUT/install.log" | head -20
  XSTAGE_SKIP_CUDA_EXT=1 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . \
    >> "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
fi
export PYTHONPATH=/tmp/site
cd /tmp  # import the installed package, not the checkout (which lacks xstage_dit.patches)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, diffusers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'diffusers', diffusers.__version__)" | tee -a "$OUT/gpu.txt"
[ $# -eq 0 ] && set -- tests
for bench_args in "$@"; do
  if [ "$bench_args" = tests ]; then
    # XSTAGE_GPU_TESTS narrows the run with a pytest -k expression
    python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 300 -k "${XSTAGE_GPU_TESTS:-}" "$REPO/tests" 2>&1 \
      | tee "$OUT/pytest-gpu.log" \
      | grep -v "^  " | tail -25
    continue
  fi
  if [ "$bench_args" = calibrate ]; then
    python3 -m xstage_dit.cli calibrate 2>&1 | tee "$OUT/calibrate.log" | tail -5
    continue
  fi
  if [ "$bench_args" = kernels ]; then
    python3 "$REPO/examples/bench_kernels.py" --out "$OUT/kernels-h200" 2>&1 | tee -a "$OUT/bench.log" | tail -25
    continue
  fi
  # shellcheck disable=SC2086  # each argument is a list of bench_e2e.py arguments
  python3 "$REPO/examples/bench_e2e.py" --out "$OUT/e2e-h200" $bench_args 2>&1 | tee -a "$OUT/bench.log" \
    | grep -v Warning | tail -8
done
