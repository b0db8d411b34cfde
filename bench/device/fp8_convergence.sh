#!/usr/bin/env bash
# FP8 convergence on one GPU (issue "FP8 training"): the 125M recipe (configs/125m.yaml) for 2,000 steps in bf16 and
# in each torchao FP8 recipe, same seed and data, plus a bf16 repeat with another seed (other init and data order):
# the bf16 pair's gap in final smoothed loss is the tolerance the FP8 runs are held to (`anytrain compare --final`).
# All five runs share the GPU at once (their tokens/s are not benchmarks). global_batch 8 (no accumulation, as the
# H100 convergence runs) keeps the five runs inside one call; fp8_filter aligned converts every block Linear (auto
# would leave a 768-wide model's GEMMs in bf16, testing nothing). The corpus is prepared here and carried.
# Three files come back (the device tool returns at most eight): the runs' metrics.jsonl and config.yaml as
# $OUT/fp8_convergence_runs.tar.gz, compare.json and the log; the PNG is drawn from the tarball where it lands:
#   tar xzf fp8_convergence_runs.tar.gz -C /tmp && anytrain compare /tmp/conv/* --final 20 --out fp8_convergence.png
#   bash bench/device/fp8_convergence.sh [seconds]   (default 560; carry .whl and data/shakespeare)
set -uo pipefail
budget=${1:-560}
OUT=$(realpath -m "${OUT:-bench/results}")
export PYTHONUNBUFFERED=1
[ -d /tmp/site/torchao ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:src
[ -f data/shakespeare/index.json ] || python3 -m anytrain prepare shakespeare --out data/shakespeare --vocab-size 8192
runs=/tmp/conv
common=(--train.steps 2000 --train.global_batch 8 --train.micro_batch 8 --train.eval_interval 250
  --train.log_interval 10 --checkpoint.interval 0)
train() {  # name, extra overrides...
  local name=$1
  shift
  timeout $((budget - SECONDS - 40)) python3 -m anytrain train configs/125m.yaml --run-dir "$runs/$name" --overwrite \
    "${common[@]}" "$@" \
    >"$runs/$name.log" 2>&1
  echo "$name exit $? $(tail -1 "$runs/$name.log")"
}
mkdir -p "$runs"
train bf16 &
train bf16-seed2 --train.seed 4321 &
for recipe in tensorwise rowwise rowwise_with_gw_hp; do
  train "fp8-$recipe" --train.fp8 "$recipe" --train.fp8_filter aligned &
done
wait
(cd /tmp && tar czf "$OUT/fp8_convergence_runs.tar.gz" conv/*/metrics.jsonl conv/*/config.yaml conv/*.log)
# the tolerance: the bf16 repeat's gap (final smoothed loss over the last 20 logged losses, i.e. 200 steps)
tol=$(python3 -m anytrain compare "$runs/bf16" "$runs/bf16-seed2" --final 20 --json | python3 -c "import json, sys
print(json.load(sys.stdin)['final']['differences']['bf16-seed2']['loss'])")
echo "bf16 repeat spread (final smoothed loss): $tol"
python3 -m anytrain compare "$runs/bf16" "$runs/bf16-seed2" "$runs/fp8-tensorwise" "$runs/fp8-rowwise" \
  "$runs/fp8-rowwise_with_gw_hp" --final 20 --json >"$OUT/fp8_convergence_compare.json"
python3 -m anytrain compare "$runs/bf16" "$runs/fp8-tensorwise" "$runs/fp8-rowwise" "$runs/fp8-rowwise_with_gw_hp" \
  --final 20 --assert-within "$tol" --assert-metric loss
echo "assert-within $tol on the final smoothed loss: exit $?"
echo "done at ${SECONDS}s"
