#!/usr/bin/env bash
# Nsight Compute profile of the pipelined kernels on the bench's large bf16 shapes
# (rms forward and backward 32768 x 2048, q/k forward 524288 x 256, gated forward
# 2^21 x 128): speed of light,
# occupancy, launch statistics and warp stall reasons, as CSV under $OUT (default .).
# PEERS=1: the same forwards through torch.compile of the transformers modules (their
# triton kernels), into $OUT/ncu_peers.csv, to compare with ours; FLA=1: FLA's rms and
# gated norm kernels, into $OUT/ncu_fla.csv. BACKWARD=1: also the gated backward (and
# our fused forward and backward), see scripts/ncu_kernels.py. SMALL=1: the norm's forward
# and backward at 1, 64 and 4096 rows of 2048 and 64 of 256 instead, every kernel of ours
# (or, with PEERS=1, torch.compile's), into ncu_small.csv (ncu_small_peers.csv). GATED=1:
# the gated forward 2^21 x 128 alone (ours in both conventions, or with PEERS=1 torch.compile's), into
# ncu_gated.csv (ncu_gated_peers.csv). LIGER=1 (with SMALL=1): Liger's kernels on the small
# work instead, into ncu_small_liger.csv.
# Only the second round of scripts/ncu_kernels.py is profiled (cudaProfilerStart/Stop).
# The clocks are left alone (--clock-control none), as the lent H200's notes ask.
# CACHE=none: ncu's --cache-control none, so that it does not flush the caches before each
# kernel (by default, all, it does); the CSV's name then ends in _warm. What the caches hold
# is then what ncu's own replay passes of the same kernel left, not the bench's warm state.
# FILTER (an ncu -k argument, e.g. regex:bwd) narrows the profiled kernels; CSV_SUFFIX=_x
# names the CSV ncu_x.csv (ncu_fla_x.csv, ...) so that a narrowed run overwrites no other.
set -euo pipefail
OUT=${OUT:-.}
if [ "${PEERS:-0}" = 1 ]; then
  [ "${LIGER:-0}" = 1 ] && { echo "PEERS=1 and LIGER=1: one of them" >&2; exit 2; }
  filter='regex:triton_'; args=--peers; csv="$OUT/ncu_peers.csv"
elif [ "${LIGER:-0}" = 1 ]; then
  [ "${SMALL:-0}" = 1 ] || { echo "LIGER=1 needs SMALL=1" >&2; exit 2; }
  [ "${FLA:-0}" = 1 ] && { echo "LIGER=1 and FLA=1: one of them" >&2; exit 2; }
  filter='regex:_rms_norm_'; args=--liger; csv="$OUT/ncu_small_liger.csv"
elif [ "${FLA:-0}" = 1 ]; then
  filter='regex:layer_norm'; args=--fla; csv="$OUT/ncu_fla.csv"
else
  normspec build > "$OUT/ncu-build.log" 2>&1
  filter='regex:normspec_(fwd|bwd)_(pipe|row)'; args=; csv="$OUT/ncu.csv"
fi
[ "${BACKWARD:-0}" = 1 ] && args="$args --backward"
if [ "${SMALL:-0}" = 1 ]; then
  args="$args --small"
  if [ "${PEERS:-0}" = 1 ]; then csv="$OUT/ncu_small_peers.csv"
  elif [ "${LIGER:-0}" != 1 ]; then filter='regex:normspec_'; csv="$OUT/ncu_small.csv"; fi
elif [ "${GATED:-0}" = 1 ]; then
  args="$args --gated"
  [ "${PEERS:-0}" = 1 ] && csv="$OUT/ncu_gated_peers.csv" || csv="$OUT/ncu_gated.csv"
fi
[ "${CACHE:-all}" = none ] && csv="${csv%.csv}_warm.csv"
filter=${FILTER:-$filter}  # FILTER=regex:...: only the kernels it names
csv="${csv%.csv}${CSV_SUFFIX:-}.csv"
ncu --clock-control none --cache-control "${CACHE:-all}" --profile-from-start off -k "$filter" \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis --section InstructionStats --csv --page raw \
  python3 scripts/ncu_kernels.py $args > "$csv" 2> "${csv%.csv}.err"
python3 - "$csv" <<'PY'
import csv, sys
rows = list(csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')))
names, units, kernels = rows[0], rows[1], rows[2:]
keep = ("gpu__time_duration.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
        "sm__throughput.avg.pct_of_peak_sustained_elapsed",
        "sm__warps_active.avg.pct_of_peak_sustained_active", "launch__registers_per_thread",
        "launch__occupancy_limit_registers", "launch__occupancy_limit_shared_mem",
        "launch__grid_size", "smsp__issue_active.avg.pct_of_peak_sustained_active",
        "smsp__inst_executed.sum", "smsp__thread_inst_executed.sum")
kname = names.index("Kernel Name")
for k in kernels:
    print("==", k[kname].split("(")[0])
    for i, n in enumerate(names):
        stall = n.startswith("smsp__average_warps_issue_stalled_") and n.endswith("_per_issue_active.ratio")
        if n in keep or stall:
            try:
                v = float(k[i].replace(",", ""))
            except ValueError:
                continue
            if stall and v < 0.3:
                continue
            print(f"   {n.replace('smsp__average_warps_issue_stalled_', 'stall ').replace('_per_issue_active.ratio', ''):<58} {v:>12.2f} {units[i]}")
PY
