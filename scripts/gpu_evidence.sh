#!/usr/bin/env bash
# Produce the GPU evidence committed in this repository: CUDA tests, the CUDA
# conformance reports (reports/cuda_*/), divergence matrices (reports/compare/)
# and benchmarks (bench/results/). Run on a CUDA machine from the repo root,
# after installing nox, fla-core, liger-kernel and megatron-core (on the lent
# H200: `source .whl/prelude.sh` with the wheels of ../shared/device/fetch-wheels.sh).
#
#   scripts/gpu_evidence.sh [tests] [conformance] [bench] [conformance-ours] [compare] [sweep] [ncu] [ncu-peers] [ncu-fla] [ncu-small] [ncu-small-liger] [ncu-source] [ncu-source-bwd] [launch-floor] [code-warmth] [small-repeat] [launch-overhead] [weight-early] [raw-weight] [quad] [block-fold] [warp-team] [bwd-off32] [bwd-depth2] [racecheck]
#   (default: all but sweep; stage limits via BUILD_LIMIT, TESTS_LIMIT, CONF_LIMIT, SWEEP_LIMIT, ...;
#   TESTS_WORKERS: pytest-xdist processes for the tests stage, where xdist is installed;
#   CONF_JOBS: the conformance stage's worker processes (normspec conformance --jobs);
#   TESTS_PATHS narrows the tests, SWEEP_ARGS are passed to bench/geometry_sweep.py,
#   BACKWARD=1 adds the gated backward to the ncu stages; SKIP_BUILD=1 skips the first
#   default build; small-repeat's REPEAT_LIMIT bounds each of its runs, REPEAT_AFTER_FLUSH
#   picks them: "0", "1" (the default "0 1"), "w" warm)
# A copy of the tree without .git should be given NORMSPEC_GIT_COMMIT (and
# NORMSPEC_GIT_DIRTY=1 if it had changes) so that the reports name their commit.
#
# Each stage has a time limit so that a slow stage cannot eat the others. $OUT
# (default: ./gpu-evidence) gets summary.log, evidence.tgz (reports/ and bench/results/)
# and logs.tgz (every stage's log, from a folder outside $OUT), both refreshed after
# every stage: the device tool brings back at most 8 files from $OUT, in name order, and
# a run of many stages left one loose log per stage there (the ncu stages add their
# reports under $OUT/ncu).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-evidence}
mkdir -p "$OUT"
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/gpu-evidence-logs.XXXXXX")
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} COLUMNS=200
stages=${*:-tests conformance bench compare}
run() {  # run LIMIT NAME CMD...: time-limited stage with its log
  local limit=$1 name=$2; shift 2
  echo "=== $name: $*" | tee -a "$OUT/summary.log"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.log"
  tail -n 25 "$LOGS/$name.log"
  # keep what exists so far, in case a later stage outlives the lease
  tar czf "$OUT/evidence.tgz" reports bench/results 2>/dev/null
  tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$OUT/summary.log"
# the GPU's name as the committed ncu CSVs are named (H200 for "NVIDIA H200")
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | sed 's/NVIDIA //; s/ /_/g')
# the commit the saved files are named after
commit=${NORMSPEC_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
sanitize() {  # sanitize NAME TOOL [VAR=VALUE ...]: one compute-sanitizer tool over our kernels
  local name=$1 tool=$2; shift 2
  run ${SANITIZER_LIMIT:-300} "$name" env "$@" compute-sanitizer --tool "$tool" \
    --kernel-name kns=normspec --error-exitcode 1 python3 scripts/sanitize_small.py
}
backward_switch_ab() {  # backward_switch_ab NAME SETTING ROUNDS: a build-time switch of the
  # backward (SETTING, e.g. NORMSPEC_BWD_OFF32=1) against the default in the micro harness,
  # the gated 2^21 x 128 included (ab.py checks that y, dx, dweight and dgate hash alike),
  # into bench/results/sweeps/bwd_NAME_<commit>.json; then the extension built with it runs
  # its CUDA tests
  local name=$1 setting=$2 rounds=$3
  mkdir -p bench/results/sweeps
  run ${MICRO_LIMIT:-300} "bwd-$name" python3 bench/micro/ab.py \
    bench/micro/small_backward_ab.cu --build "" "--build=-D$setting" \
    --env NORMSPEC_AB_GATED=1 --rounds "$rounds" \
    --out "bench/results/sweeps/bwd_${name}_${commit}.json"
  run ${BUILD_LIMIT:-240} "build-$name" env "NORMSPEC_BUILD_DEFINES=$setting" normspec build
  run ${TESTS_LIMIT:-200} "pytest-cuda-$name" env "NORMSPEC_BUILD_DEFINES=$setting" \
    python3 -m pytest -q -m cuda -p no:cacheprovider $(xdist_workers) tests/test_torch_ext_cuda.py
}
xdist_workers() {  # pytest's -n TESTS_WORKERS (default 8) where pytest-xdist is installed
  python3 -c "import xdist" 2>/dev/null && echo "-n ${TESTS_WORKERS:-8}"
}
# SKIP_BUILD=1: no default build first (stages that build their own, like bwd-off32)
[ "${SKIP_BUILD:-0}" = 1 ] || run ${BUILD_LIMIT:-240} build normspec build
for s in $stages; do
  case $s in
    tests)  # in TESTS_WORKERS processes (default 8) where pytest-xdist is installed
      workers=$(xdist_workers)
      run ${TESTS_LIMIT:-200} pytest-cuda python3 -m pytest -q -m cuda -p no:cacheprovider \
        $workers ${TESTS_PATHS:-tests} ;;
    conformance)  # every backend on every CUDA profile, in CONF_JOBS processes side by side
      # (default 8); CONFORMANCE_ARGS e.g. "--quick"
      run ${CONF_LIMIT:-540} conformance-cuda python3 -m nox -s conformance-cuda -- \
        --jobs ${CONF_JOBS:-8} ${CONFORMANCE_ARGS:-} ;;
    conformance-ours)  # fp16 and fp32: the spec, our kernels and transformers only
      for p in cuda_fp16 cuda_fp32; do
        run ${CONF_OURS_LIMIT:-240} "conformance-$p" python3 -m nox -s conformance-cuda -- \
          --profile "$p" --backend reference --backend torch_ext --backend cupy \
          --backend transformers ${CONFORMANCE_ARGS:-}
      done ;;
    compare)
      for op in rms_norm fused_add_rms_norm rms_norm_gated; do
        run 120 "compare-$op" normspec compare --op "$op" --profile cuda_bf16 \
          --json "reports/compare/$op-cuda_bf16.json" --png "reports/compare/$op-cuda_bf16.png"
      done ;;
    sweep)
      run ${SWEEP_LIMIT:-420} geometry-sweep python3 bench/geometry_sweep.py ${SWEEP_ARGS:-} ;;
    ncu)  # Nsight Compute of the pipelined kernels; the CSV goes into the tarball
      mkdir -p "$OUT/ncu" bench/results/ncu
      run ${NCU_LIMIT:-150} ncu env OUT="$OUT/ncu" bash scripts/ncu_profile.sh
      cp "$OUT/ncu/ncu.csv" "bench/results/ncu/pipe_kernels_${gpu}.csv" 2>/dev/null ;;
    ncu-peers)  # the same forwards through torch.compile (triton kernels), for comparison
      mkdir -p "$OUT/ncu" bench/results/ncu
      run ${NCU_LIMIT:-240} ncu-peers env OUT="$OUT/ncu" PEERS=1 bash scripts/ncu_profile.sh
      cp "$OUT/ncu/ncu_peers.csv" "bench/results/ncu/torch_compile_${gpu}.csv" 2>/dev/null ;;
    ncu-fla)  # FLA's rms and gated norm kernels (BACKWARD=1 for the gated backward too)
      mkdir -p "$OUT/ncu" bench/results/ncu
      run ${NCU_LIMIT:-240} ncu-fla env OUT="$OUT/ncu" FLA=1 bash scripts/ncu_profile.sh
      cp "$OUT/ncu/ncu_fla.csv" "bench/results/ncu/fla_${gpu}.csv" 2>/dev/null ;;
    ncu-small)  # the norm at 1, 64 and 4096 rows of 2048 and 64 of 256 (the committed CSVs
      # before notes §33 lack the last): our kernels, then torch.compile's
      # (CACHE=none: without ncu's cache flush, into the *_warm files)
      mkdir -p "$OUT/ncu" bench/results/ncu
      w=; [ "${CACHE:-all}" = none ] && w=_warm
      run ${NCU_LIMIT:-150} ncu-small env OUT="$OUT/ncu" SMALL=1 bash scripts/ncu_profile.sh
      cp "$OUT/ncu/ncu_small${w}.csv" "bench/results/ncu/small${w}_${gpu}.csv" 2>/dev/null
      run ${NCU_LIMIT:-240} ncu-small-peers env OUT="$OUT/ncu" SMALL=1 PEERS=1 bash scripts/ncu_profile.sh
      cp "$OUT/ncu/ncu_small_peers${w}.csv" "bench/results/ncu/small_torch_compile${w}_${gpu}.csv" 2>/dev/null ;;
    ncu-small-liger)  # Liger's kernels on the same small work (CACHE as above)
      mkdir -p "$OUT/ncu" bench/results/ncu
      w=; [ "${CACHE:-all}" = none ] && w=_warm
      run ${NCU_LIMIT:-150} ncu-small-liger env OUT="$OUT/ncu" SMALL=1 LIGER=1 bash scripts/ncu_profile.sh
      cp "$OUT/ncu/ncu_small_liger${w}.csv" "bench/results/ncu/small_liger${w}_${gpu}.csv" 2>/dev/null ;;
    ncu-source)  # the gated forward's per-instruction stall samples: ours, then torch.compile's
      # (a full report of one launch each, then its SASS page as CSV, to read off the device)
      mkdir -p "$OUT/ncu"  # (the build stage above built our kernels)
      for who in ours peers; do
        if [ $who = ours ]; then k='regex:normspec_fwd_pipe'; a=; else k='regex:triton_per_fused.*silu'; a=--peers; fi
        run ${NCU_LIMIT:-240} "ncu-source-$who" ncu --clock-control none --profile-from-start off \
          --set full --import-source no -k "$k" -c 1 -f -o "$OUT/ncu/gated_fwd_$who" \
          python3 scripts/ncu_kernels.py $a
        ncu -i "$OUT/ncu/gated_fwd_$who.ncu-rep" --page source --csv --print-source sass \
          > "$OUT/ncu/gated_fwd_${who}_sass.csv" 2> "$OUT/ncu/gated_fwd_${who}_sass.err"
      done
      mkdir -p bench/results/ncu  # committed as evidence, as the other ncu stages' CSVs
      cp "$OUT/ncu/gated_fwd_ours_sass.csv" "bench/results/ncu/gated_fwd_sass_${gpu}.csv" 2>/dev/null
      cp "$OUT/ncu/gated_fwd_peers_sass.csv" \
        "bench/results/ncu/gated_fwd_sass_torch_compile_${gpu}.csv" 2>/dev/null ;;
    ncu-source-bwd)  # the gated backward's (vllm, 2^21 x 128) per-instruction stall samples:
      # ours (normspec_gated_bwd_pair_kernel since 1d5c56a; before it OP 2 of the pipelined
      # backward, 'normspec_bwd_pipe_kernel<(int)2, ...' in ncu's demangled names),
      # then FLA's (notes/perf.md §36-40); SASS pages as CSV, as ncu-source
      mkdir -p "$OUT/ncu" bench/results/ncu
      for who in ours fla; do
        if [ $who = ours ]; then k='regex:normspec_gated_bwd_pair_kernel<'; a=--backward
        else k='regex:layer_norm_gated_bwd'; a='--fla --backward'; fi
        run ${NCU_LIMIT:-240} "ncu-source-bwd-$who" ncu --clock-control none \
          --profile-from-start off --set full --import-source no --kernel-name-base demangled \
          -k "$k" -c 1 -f -o "$OUT/ncu/gated_bwd_$who" python3 scripts/ncu_kernels.py $a
        ncu -i "$OUT/ncu/gated_bwd_$who.ncu-rep" --page source --csv --print-source sass \
          > "$OUT/ncu/gated_bwd_${who}_sass.csv" 2> "$OUT/ncu/gated_bwd_${who}_sass.err"
        cp "$OUT/ncu/gated_bwd_${who}_sass.csv" \
          "bench/results/ncu/gated_bwd_sass_${who}_${gpu}.csv" 2>/dev/null
      done ;;
    launch-floor)  # a one-block kernel's start after the L2 flush by parameter and code size
      run ${MICRO_LIMIT:-120} launch-floor bash -c "nvcc -O3 -std=c++17 -arch=native \
        -fmad=false -Ibackends/csrc bench/micro/launch_floor.cu -o /tmp/launch_floor \
        && /tmp/launch_floor" ;;
    launch-overhead)  # the small norms' event times split into launch lead, kernels and rest
      # (CUPTI through torch.profiler), flushed and warm, into bench/results/probes/
      run ${LAUNCH_LIMIT:-400} launch-overhead python3 bench/micro/launch_overhead.py --out "$OUT"
      cp "$OUT/launch_overhead.json" "bench/results/probes/launch_overhead_${commit}.json" \
        2>/dev/null ;;
    raw-weight)  # the warp teams' one-pass forward with its raw 16-bit weight widened after
      # the reduction (the default since 0703256) against before it (NORMSPEC_ROW_W_RAW_ONE=0,
      # a build of its own): CUPTI kernel durations (launch_overhead.py), flushed and warm,
      # two passes of the two builds alternating, into bench/results/probes/ (notes §48)
      mkdir -p bench/results/probes
      for pass in 1 2; do
        for form in default old; do
          defines=""
          [ "$form" = old ] && defines="NORMSPEC_ROW_W_RAW_ONE=0"
          run ${LAUNCH_LIMIT:-400} "raw-weight-$form-$pass" env NORMSPEC_BUILD_DEFINES="$defines" \
            python3 bench/micro/launch_overhead.py --case norm:64:256 --case norm:4096:256 \
            --case norm:64:128 --direction forward --flush-mib 1 --flush-mib 256 \
            --backend torch_ext --calls 100 --rounds 2 --out "$LOGS/raw-weight-$form-$pass"
          cp "$LOGS/raw-weight-$form-$pass/launch_overhead.json" \
            "bench/results/probes/raw_weight_${form}_${pass}_${commit}.json" 2>/dev/null
        done
      done ;;
    quad)  # the q/k forward in vectors of four for few rows (the default since e78ff9d)
      # against the warp teams (NORMSPEC_ROW_QUAD=0, a run-time switch: one build), rows on
      # both sides of its bound: CUPTI kernel durations, flushed and warm, two passes
      # alternating, into bench/results/probes/ (notes §49)
      mkdir -p bench/results/probes
      for pass in 1 2; do
        for form in default off; do
          quad=1
          [ "$form" = off ] && quad=0
          run ${LAUNCH_LIMIT:-400} "quad-$form-$pass" env NORMSPEC_ROW_QUAD=$quad \
            python3 bench/micro/launch_overhead.py --case norm:64:256 --case norm:256:256 \
            --case norm:512:256 --case norm:64:128 --case norm:512:128 --case norm:1024:128 \
            --direction forward --flush-mib 1 --flush-mib 256 --backend torch_ext \
            --backend cupy --calls 100 --rounds 2 --out "$LOGS/quad-$form-$pass"
          cp "$LOGS/quad-$form-$pass/launch_overhead.json" \
            "bench/results/probes/row_quad_${form}_${pass}_${commit}.json" 2>/dev/null
        done
      done ;;
    weight-early)  # the one-row forward with the weight loaded with the row (the default
      # since 71f0ae0) against after the reduction (-DNORMSPEC_ROW_WEIGHT_EARLY=0), after
      # the 512 MiB flush and warm; ab.py checks that both builds' outputs hash alike
      # (notes/perf.md §32-33); the rms and fused cases only (the flag leaves the gated
      # forms as they are)
      mkdir -p bench/results/sweeps
      run ${MICRO_LIMIT:-420} weight-early env NORMSPEC_AB_ONLY=rms,fused \
        python3 bench/micro/ab.py bench/micro/row_forward_ab.cu \
        --build "" --build=-DNORMSPEC_ROW_WEIGHT_EARLY=0 --env "" --env NORMSPEC_AB_FLUSH_MIB=1 \
        --rounds 3 --out "bench/results/sweeps/row_weight_early_${commit}.json" ;;
    block-fold)  # the small rms forward and backward with the warp partials folded in every
      # lane and the one-row forward's row from blockIdx.x (the defaults since session 29)
      # against the shuffle fold and the row from the thread index, after the 512 MiB flush
      # and warm; ab.py checks that both builds' dx and dweight hash alike (notes §34)
      mkdir -p bench/results/sweeps
      run ${MICRO_LIMIT:-420} block-fold python3 bench/micro/ab.py \
        bench/micro/small_backward_ab.cu --build "" \
        --build="-DNORMSPEC_BLOCK_FOLD_LOCAL=0 -DNORMSPEC_FWD_ROW_PER_BLOCK=0" \
        --env "" --env NORMSPEC_AB_FLUSH_MIB=1 --rounds 3 \
        --out "bench/results/sweeps/block_fold_${commit}.json" ;;
    warp-team)  # the small forwards and backwards: the default (the one-row forward's
      # row in 32 bits since session 30) against the 64-bit row and against the warp teams'
      # final broadcast skipped (an experiment), after the 512 MiB flush and warm; ab.py
      # checks that the builds' y, dx and dweight hash alike (notes §35)
      mkdir -p bench/results/sweeps
      run ${MICRO_LIMIT:-420} warp-team python3 bench/micro/ab.py \
        bench/micro/small_backward_ab.cu --build "" --build=-DNORMSPEC_FWD_ROW_SLOT32=0 \
        --build=-DNORMSPEC_TEAM_SKIP_BROADCAST=1 \
        --env "" --env NORMSPEC_AB_FLUSH_MIB=1 --rounds ${WARP_TEAM_ROUNDS:-3} \
        --out "bench/results/sweeps/warp_team_${commit}.json" ;;
    bwd-off32)  # the pipelined backward's constant forms with 32-bit row and offset
      # arithmetic (NORMSPEC_BWD_OFF32=1, an experiment; notes/perf.md §36) against the default
      backward_switch_ab off32 NORMSPEC_BWD_OFF32=1 ${OFF32_ROUNDS:-3} ;;
    bwd-depth2)  # the gated backward's gate-table forms one row ahead (NORMSPEC_BWD_DEPTH2=0)
      # against the default, two rows ahead since 438c41d's A/B (notes/perf.md §38-§39)
      backward_switch_ab depth2 NORMSPEC_BWD_DEPTH2=0 ${DEPTH2_ROUNDS:-3} ;;
    racecheck)  # compute-sanitizer's racecheck, then synccheck, over our kernels (normspec*)
      # on scripts/sanitize_small.py's work; a hazard fails the stage (exit 1), and each
      # tool's log is kept in bench/results/probes/<tool>_<commit>.txt; RACECHECK_PLANTED=1
      # adds racecheck over a build with a known race (it should fail)
      mkdir -p bench/results/probes
      for tool in racecheck synccheck; do
        sanitize "$tool" "$tool"
        cp "$LOGS/$tool.log" "bench/results/probes/${tool}_${commit}.txt" 2>/dev/null
      done
      if [ "${RACECHECK_PLANTED:-0}" = 1 ]; then
        # the checker checked: a build with the race 8275b61 fixed put back, which racecheck
        # should report (this stage's rc=1 is then the expected outcome)
        planted=NORMSPEC_BWD_SAVED_SAME_HALF=1
        run ${BUILD_LIMIT:-240} build-planted env NORMSPEC_BUILD_DEFINES=$planted normspec build
        sanitize racecheck-planted racecheck NORMSPEC_BUILD_DEFINES=$planted
        cp "$LOGS/racecheck-planted.log" \
          "bench/results/probes/racecheck_planted_${commit}.txt" 2>/dev/null
      fi ;;
    code-warmth)  # the small rms backward after the flush with its code, data or pages warmed
      run ${MICRO_LIMIT:-200} code-warmth python3 bench/micro/code_warmth_small.py --out "$OUT" ;;
    small-repeat)  # the small cases in three fresh processes each, first with the bench's
      # protocol, then with one no-op kernel after the flush (notes/perf.md §31), ranked
      # into bench/results/repeat/ (the benchmarks page renders every file there)
      # REPEAT_AFTER_FLUSH="w" (or a list with w) adds the warm run: a 1 MiB flush, L2 and
      # the code left warm (notes/perf.md §32), into small_warm_flush_1mib_<commit>.json;
      # REPEAT_TAG=T names the files small_..._T_<commit>.json (a run under switches)
      mkdir -p bench/results/repeat
      for k in ${REPEAT_AFTER_FLUSH:-0 1}; do
        if [ "$k" = w ]; then
          how="--flush-mib 1"; name=small_warm_flush_1mib
        else
          how="--after-flush-kernels $k"; name=small_after_flush_$k
        fi
        run ${REPEAT_LIMIT:-280} "small-repeat-$k" python3 bench/repeat.py --processes 3 \
          --out "$OUT/repeat_$k" -- --case norm:1:2048 --case norm:64:2048 \
          --case norm:4096:2048 --case norm:64:256 --case norm:4096:256 --rounds 5 \
          --backend torch_ext --backend compile --backend liger $how
        cp "$OUT/repeat_$k"/*.json \
          "bench/results/repeat/${name}${REPEAT_TAG:+_$REPEAT_TAG}_${commit}.json" 2>/dev/null
      done ;;
    bench)
      run ${BENCH_LIMIT:-400} bench python3 -m nox -s bench -- --quick ;;
  esac
done
tar czf "$OUT/evidence.tgz" reports bench/results 2>/dev/null
cat "$OUT/summary.log"
