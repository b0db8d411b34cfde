#!/usr/bin/env bash
# FP8 convergence on one GPU (issue "FP8 training"): the 125M recipe (configs/125m.yaml) for 2,000 steps in bf16 and
# in each torchao FP8 recipe, same seed and data, plus a bf16 repeat with another seed (other init and data order):
# the bf16 pair's gap in final smoothed loss is the tolerance the FP8 runs are held to (`anytrain compare --final`).
# All five runs share the GPU at once (their tokens/s are not benchmarks). global_batch 16 (no accumulation) keeps the
# whole call near 6 minutes on an H200; fp8_filter aligned converts every block Linear (auto would leave a
# 768-wide model's GEMMs in bf16, testing nothing). The corpus is prepared here and carried: data/shakespeare.
#   bash bench/device/fp8_convergence.sh            (carry .whl and data/shakespeare; results under $OUT/convergence)
set -uo pipefail
OUT=${OUT:-bench/results}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >/dev/null 2>&1
export PYTHONPATH=/tmp/site:src
[ -f data/shakespeare/index.json ] || python3 -m anytrain prepare shakespeare --out data/shakespeare --vocab-size 8192
runs=/tmp/conv
common=(--train.steps 2000 --train.global_batch 16 --train.micro_batch 16 --train.eval_interval 250
  --train.log_interval 10 --checkpoint.interval 0)
train() {  # name, extra overrides...
  local name=$1
  shift
  python3 -m anytrain train configs/125m.yaml --run-dir "$runs/$name" --overwrite "${common[@]}" "$@" \
    >"$runs/$name.log" 2>&1
  echo "$name exit $? $(tail -1 "$runs/$name.log")"
}
mkdir -p "$runs" "$OUT/convergence"
train bf16 &
train bf16-seed2 --train.seed 4321 &
for recipe in tensorwise rowwise rowwise_with_gw_hp; do
  train "fp8-$recipe" --train.fp8 "$recipe" --train.fp8_filter aligned &
done
wait
for name in bf16 bf16-seed2 fp8-tensorwise fp8-rowwise fp8-rowwise_with_gw_hp; do
  cp "$runs/$name/metrics.jsonl" "$OUT/convergence/$name.metrics.jsonl" 2>/dev/null
  cp "$runs/$name/config.yaml" "$OUT/convergence/$name.config.yaml" 2>/dev/null
done
# the tolerance: the bf16 repeat's gap (final smoothed loss over the last 20 logged losses, i.e. 200 steps)
python3 -m anytrain compare "$runs/bf16" "$runs/bf16-seed2" --final 20 --json >"$OUT/convergence/bf16_spread.json"
tol=$(python3 -c "import json; d=json.load(open('$OUT/convergence/bf16_spread.json')); print(max(v for v in d['final']['differences']['bf16-seed2'].values() if v is not None))")
echo "bf16 repeat spread (final smoothed loss / last val_loss): $tol"
python3 -m anytrain compare "$runs/bf16" "$runs/bf16-seed2" "$runs/fp8-tensorwise" "$runs/fp8-rowwise" \
  "$runs/fp8-rowwise_with_gw_hp" --final 20 --out "$OUT/convergence/fp8_convergence.png" --json \
  >"$OUT/convergence/compare.json"
python3 -m anytrain compare "$runs/bf16" "$runs/fp8-tensorwise" "$runs/fp8-rowwise" "$runs/fp8-rowwise_with_gw_hp" \
  --final 20 --assert-within "$tol"
echo "assert-within $tol: exit $?"
