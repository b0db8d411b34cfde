#!/usr/bin/env bash
# A/B of trainer options on the weak-scaling pair (1 GPU vs gathered FSDP on 2 GPUs), several rounds in one call so
# that the run-to-run spread is visible (issue #6). Variants:
#   gc-auto  --train.gc_interval 0 (Python's automatic GC, the behaviour before train.gc_interval)
#   gc50     the default (automatic GC off, a young-generation collection every 50 steps)
#   nosync   gc50 + no per-step host agreement: guard.py is patched IN THIS COPY of the tree to skip the all_reduce +
#            .tolist() that every multi-GPU step does, and rows run with --train.check_finite false (an experiment:
#            no preemption or non-finite agreement; the tree is restored afterwards)
# Usage (GPU host, repo root, data/ carried): bash bench/device/weak_ab.sh [seconds budget, default 420]
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
budget=${1:-420}
start=$(date +%s)
guard=src/anytrain/train/guard.py
cp "$guard" /tmp/guard.py.orig
rows_both="t-1-g8 m-1-g8 t-fsdpg-2-g16 m-fsdpg-2-g16"
rows_t="t-1-g8 t-fsdpg-2-g16"
run() {  # variant tag rows...
  local variant=$1 tag=$2; shift 2
  if [ $(( $(date +%s) - start )) -gt "$budget" ]; then echo "skip $tag (budget)"; return; fi
  cp /tmp/guard.py.orig "$guard"
  local args=""
  case $variant in
    gc-auto) args="--train.gc_interval 0" ;;
    gc50) args="" ;;
    nosync) args="--train.check_finite false"
            sed -i 's/if not (train.check_finite or train.spike_factor or self.world_size > 1):/if not (train.check_finite or train.spike_factor):/' "$guard"
            grep -q "if not (train.check_finite or train.spike_factor):" "$guard" || { echo "patch failed"; return; } ;;
  esac
  echo "== $tag ($variant: $args) at $(( $(date +%s) - start ))s"
  python3 bench/scaling.py --only "$@" --steps 16 --log-interval 4 --job-timeout-s 150 --out "$OUT" --tag "ab_$tag" \
    --train-args "$args" 2>&1 | grep -E "^(t|m)-|done|error" | grep -v "^\[.*start"
}
run gc-auto gcauto_1 $rows_both
run nosync nosync_1 $rows_both
run gc50 gc50_1 $rows_both
run gc-auto gcauto_2 $rows_t
run nosync nosync_2 $rows_t
run gc50 gc50_2 $rows_t
cp /tmp/guard.py.orig "$guard"
