#!/usr/bin/env bash
# One-GPU jobs spread over the GPUs of one host, in one device-machine call: each line of JOBS (a shell command run from
# the repo root; blank lines and # comments skipped) goes to the GPU with the least queued work, in order, with
# CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES set to it; each GPU runs its jobs one after another, each under
# `timeout` (the line's own "T=<seconds> " prefix, else $JOB_TIMEOUT_S, default 300). Every job writes into
# $R/<n>/ (exported as $JOB_OUT: pass it to a bench's --out) and logs to $R/<n>.log; at the end everything is packed
# into ONE file, $OUT/spread.tgz (the device tool returns at most 8 files per call), with a summary per job.
#   bash bench/device/spread.sh JOBS [GPUS]      (GPUS: how many to use; default all that nvidia-smi/rocm-smi list)
# Example JOBS file:
#   T=480 bash bench/device/eval_check.sh --out $JOB_OUT
#   python3 -m bench.alibi --out $JOB_OUT --rows train-alibi-flex train-alibi-hfmpt
#   python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider
set -uo pipefail
jobs_file=${1:?usage: bash bench/device/spread.sh JOBS [GPUS]}
export PYTHONPATH=${PYTHONPATH:-src} PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
R=$(mktemp -d /tmp/spread.XXXX)
n=${2:-$( (nvidia-smi -L 2>/dev/null || rocm-smi --showid 2>/dev/null | grep -E '^GPU\[') | grep -c . )}
[ "$n" -ge 1 ] || { echo "error: no GPU found (pass GPUS to force a count)" >&2; exit 2; }
key=CUDA_VISIBLE_DEVICES
command -v rocm-smi >/dev/null 2>&1 && ! command -v nvidia-smi >/dev/null 2>&1 && key=HIP_VISIBLE_DEVICES
mapfile -t lines < <(grep -v -E '^\s*(#|$)' "$jobs_file")
declare -a queue load
for ((g = 0; g < n; g++)); do queue[g]=""; load[g]=0; done
for i in "${!lines[@]}"; do  # least-loaded GPU by summed timeouts
  t=${JOB_TIMEOUT_S:-300}; [[ ${lines[i]} =~ ^T=([0-9]+)\  ]] && t=${BASH_REMATCH[1]}
  best=0; for ((g = 1; g < n; g++)); do [ "${load[g]}" -lt "${load[best]}" ] && best=$g; done
  queue[best]="${queue[best]} $i"; load[best]=$((load[best] + t))
done
start=$(date +%s)
for ((g = 0; g < n; g++)); do
  (for i in ${queue[g]}; do
     line=${lines[i]}; t=${JOB_TIMEOUT_S:-300}
     [[ $line =~ ^T=([0-9]+)\ (.*)$ ]] && { t=${BASH_REMATCH[1]}; line=${BASH_REMATCH[2]}; }
     mkdir -p "$R/$i"; t0=$(date +%s)
     env "$key=$g" JOB_OUT="$R/$i" timeout "$t" bash -c "$line" >"$R/$i.log" 2>&1; rc=$?
     echo "job $i on GPU $g: rc $rc, $(( $(date +%s) - t0 )) s (limit $t): $line" | tee -a "$R/summary.txt"
   done) &
done
wait
echo "all jobs done in $(( $(date +%s) - start )) s" | tee -a "$R/summary.txt"
mkdir -p "$OUT" && tar -czf "$OUT/spread.tgz" -C "$R" . && echo "packed: $OUT/spread.tgz ($(du -h "$OUT/spread.tgz" | cut -f1))"
