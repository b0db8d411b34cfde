"""Host cost of one AdamW step under tensor parallelism: anytrain's optimizer (train/optim.py: a param group per device
mesh, foreach kernels) against per-parameter updates (torch's AdamW with ``foreach=False``: what one gets when the
parameters mix DTensors of several meshes with plain tensors, which one foreach/fused call refuses).

The model is the 1.1B Llama's parameter structure (22 blocks, 201 parameters, tensor-parallel over the ranks as the
trainer applies it) at tiny widths, so the step is pure host work: DTensor dispatch and kernel launches, the part of a
TP step that bound it on 4 H100s (docs/scaling.md). Rows run in one process per rank (torchrun), gloo on CPU or NCCL
on GPUs; each row times ``--steps`` optimizer steps after ``--warmup`` and reports rank 0's milliseconds per step.

    PYTHONPATH=src torchrun --standalone --nproc_per_node 2 -m bench.tp_optimizer --out bench/results   # CPU or GPUs
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from anytrain import hardware
from anytrain.config import load_config
from anytrain.models import get_spec, resolve_args
from anytrain.parallel import parallelize
from anytrain.parallel.mesh import ParallelDims
from anytrain.train.optim import build_optimizer, param_groups
from bench.common import save_rows

SHAPE = ["--model.flavour", "debug", "--model.args.n_layers", "22", "--model.args.vocab_size", "512"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    cfg = load_config(
        "configs/tiny.yaml",
        [*SHAPE, "--parallel.tp", str(world), "--device", "gpu" if gpu else "cpu", "--train.dtype", "fp32"],
    )
    with torch.device("meta"):
        model = get_spec(cfg.model.arch).build(resolve_args(cfg.model))
    model.to_empty(device=device)
    model.init_weights(seed=0)
    model, _ = parallelize(model, cfg, ParallelDims.from_config(cfg.parallel, world), device, torch.float32)
    n_params = sum(1 for _ in model.parameters())
    optimizers = {
        "per-parameter AdamW (foreach=False)": lambda: torch.optim.AdamW(
            param_groups(model, cfg.train.weight_decay), lr=cfg.train.lr, foreach=False
        ),
        "anytrain (groups per mesh, foreach)": lambda: build_optimizer(model, cfg.train, device, by_mesh=True),
    }
    rows = []
    for name, make in optimizers.items():
        optimizer = make()
        for param in model.parameters():
            param.grad = torch.full_like(param, 1e-3)
        for _ in range(args.warmup):
            optimizer.step()
        hardware.synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            optimizer.step()
        hardware.synchronize(device)
        ms = 1e3 * (time.perf_counter() - start) / args.steps
        rows.append(
            {
                "row": name,
                "ms_per_step": ms,
                "param_groups": len(optimizer.param_groups),
                "params": n_params,
                "tp": world,
                "steps": args.steps,
            }
        )
    if rank == 0:
        base = rows[0]["ms_per_step"]
        print(f"\n{'row':<40}{'ms/step':>10}{'groups':>8}{'vs per-parameter':>18}")
        for row in rows:
            row["speedup"] = base / row["ms_per_step"]
            print(f"{row['row']:<40}{row['ms_per_step']:>10.1f}{row['param_groups']:>8}{row['speedup']:>17.2f}x")
        print(f"{n_params} parameters, tensor parallel over {world} ranks, rank 0's host time per step")
        save_rows(f"tp_optimizer_tp{world}", args.out, rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
