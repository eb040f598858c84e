#!/usr/bin/env bash
# Produce the GPU evidence committed in this repository: the CUDA tests, the CUDA
# conformance reports (reports/cuda_*/), the divergence matrices (reports/compare/), the
# product benchmark (bench/results/<gpu>.json) and compute-sanitizer's race and sync
# checks of our kernels. Run on a CUDA machine from the repo root, after installing nox,
# fla-core, liger-kernel, megatron-core and normspec's requirements (jsonschema among them;
# the script names any that is missing before it starts) (on an offline machine: carry
# their wheels and install them first; scripts/flashinfer_offline.sh does the same for FlashInfer).
#
#   scripts/gpu_evidence.sh [tests] [conformance] [bench] [compare] [integration] [racecheck]
#
# Default: tests conformance bench compare. Each stage has a time limit (BUILD_LIMIT,
# TESTS_LIMIT, CONF_LIMIT, BENCH_LIMIT, SANITIZER_LIMIT) so that a slow stage cannot eat
# the others; TESTS_WORKERS sets pytest-xdist's processes (where it is installed),
# CONF_JOBS the conformance run's worker processes, CONFORMANCE_ARGS extra conformance
# arguments (e.g. --quick). A copy of the tree without .git should be given
# NORMSPEC_GIT_COMMIT (and NORMSPEC_GIT_DIRTY=1 if it had changes) so that the reports name
# their commit. $OUT (default ./gpu-evidence) gets summary.log, evidence.tgz (reports/ and
# bench/results/) and logs.tgz (every stage's log), refreshed after every stage.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-evidence}
mkdir -p "$OUT"
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/gpu-evidence-logs.XXXXXX")
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} COLUMNS=200
stages=${*:-tests conformance bench compare}
run() {  # run LIMIT NAME CMD...: a time-limited stage with its log
  local limit=$1 name=$2; shift 2
  echo "=== $name: $*" | tee -a "$OUT/summary.log"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.log"
  tail -n 25 "$LOGS/$name.log"
  # keep what exists so far, in case a later stage outlives the machine
  tar czf "$OUT/evidence.tgz" reports bench/results 2>/dev/null
  tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$OUT/summary.log"
# normspec's own requirements first: a package missing on the GPU machine (nothing can be
# installed there from the network) would otherwise fail a stage minutes in
needs='("torch", "rich", "numpy", "ninja", "jsonschema", "nox")'
missing=$(python3 -c "import importlib.util as u; print(*(m for m in $needs if u.find_spec(m) is None))")
if [ -n "$missing" ]; then
  echo "missing python packages: $missing (install or carry their wheels first)" \
    | tee -a "$OUT/summary.log" >&2
  exit 2
fi
commit=${NORMSPEC_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
xdist_workers() {  # pytest's -n TESTS_WORKERS (default 8) where pytest-xdist is installed
  python3 -c "import xdist" 2>/dev/null && echo "-n ${TESTS_WORKERS:-8}"
}
run ${BUILD_LIMIT:-240} build normspec build
for s in $stages; do
  case $s in
    tests)
      run ${TESTS_LIMIT:-200} pytest-cuda python3 -m pytest -q -m cuda -p no:cacheprovider \
        $(xdist_workers) tests ;;
    conformance)  # every backend on every CUDA profile, in CONF_JOBS processes side by side
      run ${CONF_LIMIT:-540} conformance-cuda python3 -m nox -s conformance-cuda -- \
        --out reports --jobs ${CONF_JOBS:-8} ${CONFORMANCE_ARGS:-} ;;
    compare)
      for op in rms_norm fused_add_rms_norm rms_norm_gated; do
        run 120 "compare-$op" normspec compare --op "$op" --profile cuda_bf16 \
          --json "reports/compare/$op-cuda_bf16.json"
      done ;;
    racecheck)  # racecheck, then synccheck, over our kernels on sanitize_small.py's work;
      # a hazard fails the stage (exit 1); the logs are in logs.tgz
      for tool in racecheck synccheck; do
        run ${SANITIZER_LIMIT:-300} "$tool" compute-sanitizer --tool "$tool" \
          --kernel-name kns=normspec --error-exitcode 1 python3 scripts/sanitize_small.py
      done ;;
    bench)
      run ${BENCH_LIMIT:-400} bench python3 -m nox -s bench -- --quick ;;
    integration)  # the transformers model patched with our norms against unpatched, and
      # the patched model's gradients against the spec (train = rollout on the GPU)
      gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' /' '__')
      run ${INTEGRATION_LIMIT:-300} integration python3 bench/integration.py \
        --out "bench/results/integration_${gpu}.json" ;;
    *) echo "unknown stage '$s' (expected tests, conformance, bench, compare, integration or" \
         "racecheck)" \
         | tee -a "$OUT/summary.log" ;;
  esac
done
echo "commit $commit" >> "$OUT/summary.log"
tar czf "$OUT/evidence.tgz" reports bench/results 2>/dev/null
cat "$OUT/summary.log"
