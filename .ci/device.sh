#!/usr/bin/env bash
# The GPU checks of the project, for the device machine (one H200): install, GPU tests, end-to-end benchmarks.
# Run from the repository root with .whl carried (../shared/device/wheels.sh fetches it). Results go to $OUT.
# The copy there has no .git: set XSTAGE_COMMIT=<commit> in the command so that records name their code.
#   bash .ci/device.sh [smoke] [tests] [calibrate] [kernels] ["BENCH_E2E ARGS" ...]
# in the order given (no argument: tests): "smoke" runs the GPU tests marked smoke (minutes: every backend on
# ranks sharing one GPU, every family at degree 1, CUDA-graph replays, FP8 attention, payloads and linear layers,
# quantized models; log pytest-smoke.log), "tests" all the GPU
# tests but the calibration ones (for changes to the kernels or the exchange; longer than one session's device
# time; log pytest-gpu.log), "calibrate" those and `xstage-dit calibrate`
# into $XSTAGE_CALIBRATION_DIR (default $OUT/calibration, where the benchmarks and backend="auto" look),
# "kernels" examples/bench_kernels.py (extra arguments in $XSTAGE_KERNELS_ARGS), every other argument is one
# quoted bench_e2e.py argument list
set -uo pipefail
source .ci/device_setup.sh
[ $# -eq 0 ] && set -- tests

# gpu_tests MARKERS LOG: the tests of a pytest -m expression, logged to $OUT/LOG. XSTAGE_GPU_TESTS narrows the run
# with a pytest -k expression; XSTAGE_TEST_TIMEOUT bounds each test (s); one line per test in the log, so that a
# run cut short still says how far it got, and each test's time at its end
gpu_tests() {
  python3 -m pytest -v -m "$1" -p no:cacheprovider --timeout "${XSTAGE_TEST_TIMEOUT:-300}" \
    --durations=0 --durations-min=1 -k "${XSTAGE_GPU_TESTS:-}" "$REPO/tests" 2>&1 \
    | tee "$OUT/$2" \
    | grep -E "FAILED|ERROR|passed|failed" | tail -25
}

for bench_args in "$@"; do
  if [ "$bench_args" = smoke ]; then
    gpu_tests "gpu and smoke and not calibration" pytest-smoke.log
    continue
  fi
  if [ "$bench_args" = tests ]; then
    gpu_tests "gpu and not calibration" pytest-gpu.log
    continue
  fi
  if [ "$bench_args" = calibrate ]; then
    python3 -m pytest -v -m calibration -p no:cacheprovider "$REPO/tests" 2>&1 | tee "$OUT/pytest-calibration.log" \
      | grep -E "FAILED|ERROR|passed|failed" | tail -10
    python3 -m xstage_dit.cli calibrate 2>&1 | tee "$OUT/calibrate.log" | tail -5
    continue
  fi
  if [ "$bench_args" = kernels ]; then
    # shellcheck disable=SC2086  # a list of arguments
    python3 "$REPO/examples/bench_kernels.py" --out "$OUT/kernels-h200" ${XSTAGE_KERNELS_ARGS:-} 2>&1 \
      | tee -a "$OUT/bench.log" | tail -25
    continue
  fi
  # shellcheck disable=SC2086  # each argument is a list of bench_e2e.py arguments
  python3 "$REPO/examples/bench_e2e.py" --out "$OUT/e2e-h200" $bench_args 2>&1 | tee -a "$OUT/bench.log" \
    | grep -v Warning | tail -8
done
