#!/usr/bin/env bash
# Before/after of a change, side by side on one GPU machine: an old tree and this checkout, alternating, FLUX.1-dev
# 1024^2 and Wan 2.1 1.3B 720p (E2E_RUNS) at degree 1 compiled + graphs, E2E_STEPS steps a call (PARTS e2e), then
# bench_kernels.py's parts $KPARTS (default loopback; PARTS kernels). The old tree is made here and carried (.dev
# is in .git/info/exclude):
#   git archive REV | tar -x -C .dev/before           then, on the device (carry .whl and .dev):
#   [TESTS_K="pytest -k expr"] [PARTS="e2e kernels"] [KPARTS="loopback"] bash .ci/before_after.sh
# The old tree is installed without csrc/ (the benchmarks do not use the probes). Results go to $OUT.
set -uo pipefail
source .ci/device_setup.sh
XSTAGE_SKIP_CUDA_EXT=1 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site_before \
  "$REPO/.dev/before" > "$OUT/install-before.log" 2>&1 || { tail -20 "$OUT/install-before.log"; exit 1; }
run() {  # run TREE SITE LABEL ARGS...
  local tree=$1 site=$2 label=$3; shift 3
  echo "== $label"
  PYTHONPATH=$site:/tmp/site timeout "${RUN_S:-280}" python3 "$tree/examples/$1" "${@:2}" 2>&1 | grep -v Warning | tail -4
}
if [ -n "${TESTS_K:-}" ]; then
  t0=$(date +%s)
  timeout "${TESTS_S:-200}" python3 -m pytest -v -m "gpu and not calibration" -p no:cacheprovider --timeout 150 \
    --durations=0 --durations-min=1 -k "$TESTS_K" "$REPO/tests" > "$OUT/pytest-touched2.log" 2>&1
  echo "tests: $(( $(date +%s) - t0 )) s"; grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest-touched2.log" | tail -12
fi
if [[ "${PARTS:-kernels e2e}" == *e2e* ]]; then
  # one bench_e2e run per ;-separated spec: a config and its extra arguments
  IFS=';' read -ra specs <<< "${E2E_RUNS:-flux-dev;wan-1.3b --height 720 --width 1280}"
  for spec in "${specs[@]}"; do
    label=${spec%% *}; label=${label//./_}  # bench_e2e takes the text after a dot in --out as a suffix
    # shellcheck disable=SC2086  # spec is a list of arguments
    E="--config $spec --steps ${E2E_STEPS:-8} --repeats 2 --backend auto --modes compiled+graphs"
    run "$REPO/.dev/before" /tmp/site_before "e2e-before $label" bench_e2e.py $E --out "$OUT/eb-$label"
    run "$REPO" /tmp/site "e2e-after $label" bench_e2e.py $E --out "$OUT/ea-$label"
  done
fi
if [[ "${PARTS:-kernels e2e}" == *kernels* ]]; then
  K="--parts ${KPARTS:-loopback}"
  run "$REPO/.dev/before" /tmp/site_before kernels-before bench_kernels.py $K --out "$OUT/kb${KSUFFIX:-}"
  run "$REPO" /tmp/site kernels-after bench_kernels.py $K --out "$OUT/ka${KSUFFIX:-}"
fi
ls -la "$OUT"
