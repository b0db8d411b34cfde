#!/usr/bin/env bash
# Scan-kernel sweep for one device call (issue "Mamba ..."): the kernel GPU tests under a candidate config, then
# bench/mamba_kernels.py --sweep over forward/backward candidates (writes $OUT/chosen.env with the fastest pair).
#   ANYTRAIN_SCAN_CONFIG_TEST=<fields> bash bench/device/scan_sweep.sh --fwd-configs ... --bwd-configs ... [--diag N]
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
OUT=${OUT:-bench/results}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null || true
if [ -n "${ANYTRAIN_SCAN_CONFIG_TEST:-}" ]; then
  ANYTRAIN_SCAN_CONFIG=$ANYTRAIN_SCAN_CONFIG_TEST timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/gpu/test_mamba_kernels_gpu.py tests/gpu/test_mamba_inner_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
fi
timeout 420 python3 bench/mamba_kernels.py --out "$OUT" --sweep --no-conv-sweep "$@" 2>&1 | tee "$OUT/sweep.log" |
  grep -v '^{' | tail -40
