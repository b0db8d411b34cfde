#!/usr/bin/env bash
# One device-machine call for the multi-GPU work (issues #6, #7, #8): topology, `anytrain doctor` (all_reduce
# correctness + bus bandwidth on 2 and all GPUs), the scaling study, the cost-model validation. Run from the repo
# root on the GPU host with the prepared corpus in data/ (carry it):  bash bench/device/multi_gpu.sh [scaling args]
# Results go to bench/results/ and, when $OUT is set (the device tool), are copied there.
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi topo -m 2>/dev/null | head -n $((n + 2)) | tee "$OUT/topology.txt" || true
for g in 2 "$n"; do
  [ "$g" -le "$n" ] && [ "$g" -ge 2 ] || continue
  python3 -m torch.distributed.run --standalone --nproc_per_node "$g" -m anytrain doctor --max-mib 1024 \
    --out "bench/results/doctor_${g}gpu.json" 2>&1 | tail -n 25
done
touch /tmp/multi_gpu.start
python3 -m bench.scaling "$@"
dev=$(python3 -c 'import re, torch; print(re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-"))')
# the results file this run wrote (its name carries --tag), not an older committed one
result=$(find bench/results -maxdepth 1 -name "scaling_${dev}*.json" -newer /tmp/multi_gpu.start | head -n 1)
doctors=$(ls bench/results/doctor_*gpu.json 2>/dev/null)
if [ -n "$result" ]; then
  python3 -m bench.cost_model_validation --reuse-only --reuse "$result" ${doctors:+--doctor $doctors}
fi
# (--reuse-only writes *_reuse.json so that it never overwrites results measured on a GPU)
cp bench/results/doctor_*gpu.json $result "bench/results/cost_model_validation_${dev}_reuse.json" \
  "bench/results/efficiency_${dev}_reuse.json" "$OUT/" 2>/dev/null || true
