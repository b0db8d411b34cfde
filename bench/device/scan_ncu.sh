#!/usr/bin/env bash
# Nsight Compute profile of one launch of each scan / conv kernel at the benchmark shape, plus the scan's time against
# the number of program waves (bench/scan_probe.py). For one device call; writes under $OUT.
#   bash bench/device/scan_ncu.sh [extra ncu args]
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/scan_ncu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null || true
timeout 200 python3 bench/scan_probe.py waves --dims "${DIMS:-4224,4752,5376,6336,8448}" --out "$OUT" 2>&1 | tail -8
# launches before the profiled ones: 1 forward for the saved states + 2 warm-up rounds of 4 kernels
timeout 300 ncu --clock-control none --kernel-name regex:'_ss_|_conv_' --launch-skip 9 --launch-count 4 \
  --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section LaunchStats --section InstructionStats \
  "$@" python3 bench/scan_probe.py once > "$OUT/ncu.txt" 2>&1
echo "ncu rc $?"
grep -E "^  _|Duration|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|Achieved Occupancy|L2 Cache Throughput|L1/TEX Hit|Memory Throughput|Stall" "$OUT/ncu.txt" | head -80
