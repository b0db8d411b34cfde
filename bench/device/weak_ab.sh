#!/usr/bin/env bash
# A/B of trainer options on the weak-scaling pair (1 GPU vs gathered FSDP on 2 GPUs), several rounds in one call so
# that the run-to-run spread is visible (issue #6). Variants (--train-args of bench/scaling.py):
#   sync     --train.lagged_checks false: the per-step agreement blocks the host every step (the old behaviour)
#   lagged   the default: the agreement is read one step late (train.lagged_checks)
#   gc-auto  --train.gc_interval 0: Python's automatic GC (the behaviour before train.gc_interval)
#   pinned   --parallel.cpu_affinity cores: each rank bound to its own physical cores
# Usage (GPU host, repo root, data/ carried): bash bench/device/weak_ab.sh [seconds budget, default 420] [rounds...]
# where a round is variant:tag:t|m|tm (t = the Transformer pair only, m = the Mamba pair, tm = both). STEPS and LOG
# (environment) set the steps per row and the log interval (default 16 and 4; the recipes log every 10 steps).
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
budget=${1:-420}
shift || true
rounds=${*:-"sync:sync_1:tm lagged:lagged_1:tm sync:sync_2:t lagged:lagged_2:t"}
start=$(date +%s)
for round in $rounds; do
  IFS=: read -r variant tag models <<< "$round"
  if [ $(( $(date +%s) - start )) -gt "$budget" ]; then echo "skip $tag (budget)"; continue; fi
  case $variant in
    sync) args="--train.lagged_checks false" ;;
    lagged) args="" ;;
    gc-auto) args="--train.gc_interval 0" ;;
    pinned) args="--parallel.cpu_affinity cores" ;;
    *) echo "unknown variant $variant"; exit 2 ;;
  esac
  rows="t-1-g8 t-fsdpg-2-g16"
  [ "$models" = tm ] && rows="t-1-g8 m-1-g8 t-fsdpg-2-g16 m-fsdpg-2-g16"
  [ "$models" = m ] && rows="m-1-g8 m-fsdpg-2-g16"
  echo "== $tag ($variant: $args) at $(( $(date +%s) - start ))s"
  # shellcheck disable=SC2086
  python3 -m bench.scaling --only $rows --steps "${STEPS:-16}" --log-interval "${LOG:-4}" --job-timeout-s 150 \
    --out "$OUT" --tag "ab_$tag" \
    --train-args "$args" 2>&1 | grep -E "^(t|m)-|done|error" | grep -v "^\[.*start"
done
