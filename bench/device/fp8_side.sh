#!/usr/bin/env bash
# FP8 and torchtitan side by side on one GPU, in one call (wheels carried in .whl/: torchao, torchtitan 0.2.2 and its
# needs). Parts, run in the order given, each into $OUT/<part>/transformer_<device>.json (kept in bench/results/
# one_gpu_check_<device>.json, key fp8_side):
#   1.1b  the 1.1B recipe's shape (configs/1.1b.yaml): anytrain bf16, fp8-tensorwise, fp8-rowwise
#   1b    Llama-3.2-1B: anytrain vs torchtitan 0.2.2, bf16 / fp8-tensorwise / fp8-rowwise
#   3b    Llama-3.2-3B: the same six rows (3b-tw: bf16 and tensorwise, 3b-rw: rowwise; 3b-mb:
#         anytrain's rows at torchtitan's micro-batch; 3b-prof: anytrain bf16 and tensorwise with one-step kernel
#         profiles, and tensorwise at micro-batch 16; 3b-eq: tensorwise and rowwise at torchtitan's micro-batch;
#         3b-rw-prof: the rowwise pair at micro-batch 4, each with a one-step kernel profile)
#   1b-fp8  Llama-3.2-1B's FP8 rows only (tensorwise pair, then rowwise pair; 1b-rw: the rowwise pair;
#         3b-rw8: anytrain rowwise at 3B, its own micro-batch)
#   hf    HF + torchao float8 + torch.compile at the 1.1B and 1B shapes (tensorwise, rowwise)
#   hf-1.1b-tw  HF + torchao tensorwise at the 1.1B shape only
#   bash bench/device/fp8_side.sh [seconds] part...        (seconds: the whole call's budget)
set -uo pipefail
budget=$1
shift
OUT=${OUT:-bench/results}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >/dev/null 2>&1
export PYTHONPATH=/tmp/site:src
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
left() { echo $((budget - SECONDS)); }
rows() { grep -v '^{' | grep -E 'tokens/s|anytrain|torchtitan|HF|error|Error' | tail -12; }
common=(--no-profile --steps 6)
for part in "$@"; do
  mkdir -p "$OUT/$part"
  case $part in
    1.1b) sel=(--groups 1.1b-2048-mb16 --stacks anytrain --match "anytrain recipe" "anytrain fp8") ;;
    1b) sel=(--groups llama-1b-2048 --stacks anytrain torchtitan) ;;
    1b-fp8) sel=(--groups llama-1b-2048 --stacks anytrain torchtitan --match fp8-tensorwise fp8-rowwise) ;;
    hf-1.1b-tw) sel=(--groups 1.1b-2048-mb8 --stacks hf-compile --match "torchao fp8-tensorwise") ;;
    3b) sel=(--groups llama-3b-2048 --stacks anytrain torchtitan) ;;
    3b-tw) sel=(--groups llama-3b-2048 --stacks anytrain torchtitan --match "bf16, compile" "tensorwise, compile") ;;
    3b-mb) sel=(--groups llama-3b-2048 --stacks anytrain --match "torchtitan's micro-batch") ;;
    3b-rw) sel=(--groups llama-3b-2048 --stacks anytrain torchtitan --match fp8-rowwise) ;;
    3b-prof) sel=(--groups llama-3b-2048 --stacks anytrain --match "anytrain bf16, compile auto, no AC" \
      "tensorwise, compile auto, no AC" --exclude "torchtitan's micro-batch" --profile) ;;
    1b-rw) sel=(--groups llama-1b-2048 --stacks anytrain torchtitan --match "fp8-rowwise, compile") ;;
    3b-rw8) sel=(--groups llama-3b-2048 --stacks anytrain --match "anytrain fp8-rowwise, compile auto, no AC" \
      --exclude micro-batch) ;;
    3b-rw-prof) sel=(--groups llama-3b-2048 --stacks anytrain torchtitan --match "fp8-rowwise, compile, no AC" \
      "fp8-rowwise, compile auto, no AC, torchtitan's" --profile) ;;
    3b-eq) sel=(--groups llama-3b-2048 --stacks anytrain torchtitan --match "fp8-tensorwise, compile, no AC" \
      "fp8-rowwise, compile, no AC" "torchtitan's micro-batch" --exclude bf16) ;;
    hf) sel=(--groups 1.1b-2048-mb8 llama-1b-2048 --stacks hf-compile --match "torchao") ;;
    *) echo "unknown part $part" && exit 2 ;;
  esac
  timeout $(($(left) - 5)) python3 -m bench.transformer --out "$OUT/$part" "${common[@]}" "${sel[@]}" \
    --budget-s $(($(left) - 15)) 2>&1 | rows
done
echo "done at ${SECONDS}s"
