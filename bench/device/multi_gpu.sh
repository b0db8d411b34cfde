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
python3 bench/scaling.py "$@"
dev=$(python3 -c 'import re, torch; print(re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-"))')
doctors=$(ls bench/results/doctor_*gpu.json 2>/dev/null)
python3 bench/cost_model_validation.py --reuse-only --reuse "bench/results/scaling_${dev}.json" ${doctors:+--doctor $doctors}
# (--reuse-only writes *_reuse.json so that it never overwrites results measured on a GPU)
cp bench/results/doctor_*gpu.json "bench/results/scaling_${dev}.json" "bench/results/cost_model_validation_${dev}_reuse.json" \
  "bench/results/efficiency_${dev}_reuse.json" "$OUT/" 2>/dev/null || true
