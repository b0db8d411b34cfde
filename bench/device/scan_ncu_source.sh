#!/usr/bin/env bash
# Nsight Compute warp-stall samples per SASS instruction of one scan forward and one backward launch at the benchmark
# shape (bench/scan_probe.py once), for one device call; writes the report, a per-instruction CSV and the stall
# summary under $OUT.   bash bench/device/scan_ncu_source.sh
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/scan_ncu_source}
mkdir -p "$OUT"
# launches before the profiled ones: 1 forward for the saved states + 2 warm-up rounds of forward and backward
timeout 300 ncu --clock-control none --kernel-name regex:'_ss_' --launch-skip 5 --launch-count 2 \
  --section SourceCounters --section WarpStateStats --import-source yes -o "$OUT/scan_src" \
  python3 bench/scan_probe.py once > "$OUT/ncu_run.txt" 2>&1
echo "ncu rc $?"
ncu --import "$OUT/scan_src.ncu-rep" --page source --csv --print-source sass > "$OUT/src_sass.csv"
ncu --import "$OUT/scan_src.ncu-rep" --page details --section WarpStateStats --print-details all > "$OUT/stall.txt" 2>&1
grep -i "stall" "$OUT/stall.txt" | head -60
