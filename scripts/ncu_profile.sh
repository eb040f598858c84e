#!/usr/bin/env bash
# Nsight Compute profile of the pipelined kernels on the bench's large bf16 shapes
# (rms forward and backward 32768 x 2048, q/k forward 524288 x 256, gated forward
# 2^21 x 128): speed of light,
# occupancy, launch statistics and warp stall reasons, as CSV under $OUT (default .).
# The clocks are left alone (--clock-control none), as the lent H200's notes ask.
set -euo pipefail
OUT=${OUT:-.}
normspec build > "$OUT/ncu-build.log" 2>&1
ncu --clock-control none -k 'regex:normspec_(fwd|bwd)_(pipe|row)' --launch-skip 4 --launch-count 4 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis --section InstructionStats --csv --page raw \
  python3 scripts/ncu_kernels.py > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
python3 - "$OUT/ncu.csv" <<'PY'
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
