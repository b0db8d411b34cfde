"""What one rank can see of its host: CPUs, memory, accelerators, driver and toolkit versions, the SLURM allocation,
network interfaces, the collective library's environment variables, the GPU topology; a GEMM checked against a float64
reference (NaN / wrong-result detection) and its throughput as a fraction of the device's peak."""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
import time
from pathlib import Path

import torch

from anytrain import hardware


def _run(cmd: list[str]) -> str | None:
    """First line of a tool's output, or None when the tool is missing or fails."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def _run_text(cmd: list[str]) -> tuple[str | None, str | None]:
    """(whole output, None) of a tool, or (None, why not) when it is missing or fails."""
    if shutil.which(cmd[0]) is None:
        return None, f"{cmd[0]} not found on PATH"
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{' '.join(cmd)}: {type(exc).__name__}"
    if out.returncode != 0:
        return None, f"{' '.join(cmd)} exited {out.returncode}: {(out.stderr or out.stdout).strip()[:200]}"
    return out.stdout.rstrip(), None


def driver_versions(vendor: str) -> dict:
    """GPU driver and toolkit versions: nvidia-smi's driver on NVIDIA, the ROCm release on AMD (None where absent)."""
    if vendor == hardware.CUDA:
        return {"driver": _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])}
    if vendor == hardware.ROCM:
        info = Path("/opt/rocm/.info/version")
        return {
            "driver": _run(["cat", "/sys/module/amdgpu/version"]),
            "rocm": info.read_text().strip() if info.is_file() else None,
        }
    return {"driver": None}


def memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def network_interfaces(sysfs: str = "/sys/class/net") -> list[dict]:
    """Interfaces other than loopback: name, state, speed (Mb/s, where the driver says), InfiniBand / RoCE devices."""
    rows = []
    for name in sorted(n for _, n in socket.if_nameindex() if n != "lo"):
        base = Path(sysfs, name)

        def read(attr: str, base: Path = base) -> str | None:
            try:
                return (base / attr).read_text().strip()
            except OSError:
                return None

        speed = read("speed") or ""
        mbps = int(speed) if speed.lstrip("-").isdigit() and int(speed) > 0 else None  # -1: link down / unknown
        rows.append({"name": name, "state": read("operstate"), "speed_mbps": mbps})
    ib = Path("/sys/class/infiniband")
    if ib.is_dir():
        rows.extend({"name": dev.name, "state": "rdma", "speed_mbps": None} for dev in sorted(ib.iterdir()))
    return rows


# NCCL / RCCL (RCCL reads NCCL_* too), PyTorch's NCCL wrapper, gloo, the fabrics' libraries (UCX, libfabric for EFA
# and Slingshot), the ROCm runtime (HSA_*) and which devices the process may see.
COLLECTIVE_ENV_PREFIXES = ("NCCL_", "RCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "GLOO_", "UCX_", "FI_", "HSA_")
VISIBLE_DEVICES_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def collective_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables that steer the collective libraries in this process, sorted by name."""
    env = dict(os.environ) if env is None else env
    return {k: env[k] for k in sorted(env) if k.startswith(COLLECTIVE_ENV_PREFIXES) or k in VISIBLE_DEVICES_VARS}


def topology() -> dict:
    """The GPU interconnect matrix as the vendor tool prints it (``nvidia-smi topo -m`` / ``rocm-smi --showtopo``):
    {"host", "command", "output"} with ``reason`` instead of output where there is no GPU or the tool is missing."""
    cmd = hardware.topology_command()
    row = {"host": socket.gethostname(), "command": " ".join(cmd) if cmd else None, "output": None, "reason": None}
    if cmd is None:
        row["reason"] = "no GPU: nothing to show"
    else:
        row["output"], row["reason"] = _run_text(cmd)
    return row


def slurm_allocation(env: dict[str, str] | None = None) -> dict | None:
    """The SLURM job this process runs in (None outside SLURM)."""
    env = dict(os.environ) if env is None else env
    if "SLURM_JOB_ID" not in env:
        return None
    keys = {
        "job_id": "SLURM_JOB_ID",
        "partition": "SLURM_JOB_PARTITION",
        "nodelist": "SLURM_JOB_NODELIST",
        "nodes": "SLURM_JOB_NUM_NODES",
        "tasks": "SLURM_NTASKS",
        "gpus_on_node": "SLURM_GPUS_ON_NODE",
        "cpus_on_node": "SLURM_CPUS_ON_NODE",
        "step_id": "SLURM_STEP_ID",
    }
    return {name: env.get(key) for name, key in keys.items()}


def host_inventory(device: torch.device) -> dict:
    """This rank's host and device, as plain data (gathered from every rank by the doctor)."""
    vendor = hardware.vendor() if hardware.is_gpu(device) else hardware.CPU
    visible = torch.cuda.device_count() if hardware.vendor() != hardware.CPU else 0
    return {
        "host": socket.gethostname(),
        "os": platform.platform(),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": memory_gib(),
        "device": hardware.device_name(device),
        "vendor": vendor,
        "gpus_visible": visible,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        **driver_versions(hardware.vendor()),
    }


def gemm_throughput(device: torch.device, n: int, repeats: int = 10) -> dict:
    """Median rate of an n x n x n matmul on random data in the training dtype (bf16 on GPUs, fp32 on CPU), and its
    fraction of the device's dense bf16 peak (``hardware.peak_flops``); ``skipped`` says why there is no fraction
    (CPU, or a GPU missing from the peak table)."""
    gpu = hardware.is_gpu(device)
    dtype = torch.bfloat16 if gpu else torch.float32
    n = n if gpu else min(n, 512)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    hardware.synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        hardware.synchronize(device)
        times.append(time.perf_counter() - start)
    tflops = 2 * n**3 / sorted(times)[len(times) // 2] / 1e12
    peak = hardware.peak_flops(device)
    skipped = None
    if not gpu:
        skipped = "CPU: no peak FLOP/s to compare with"
    elif peak is None:
        skipped = f"{hardware.device_name(device)} is not in hardware.DEVICE_CATALOGUE: no peak FLOP/s"
    return {
        "dtype": str(dtype).replace("torch.", ""),
        "shape": n,
        "tflops": tflops,
        "peak_tflops": peak / 1e12 if peak else None,
        "fraction": tflops * 1e12 / peak if peak and gpu else None,
        "skipped": skipped,
    }


def gemm_check(device: torch.device, n: int = 512, seed: int = 0) -> dict:
    """A seeded matmul in the device's training dtype (bf16 on GPUs, fp32 on CPU) against a float64 reference:
    every output finite and the largest error within the dtype's tolerance (relative to the output's scale)."""
    generator = torch.Generator().manual_seed(seed)
    a64, b64 = (torch.randn(n, n, generator=generator, dtype=torch.float64) for _ in range(2))
    dtype = torch.bfloat16 if hardware.is_gpu(device) else torch.float32
    got = (a64.to(device, dtype) @ b64.to(device, dtype)).double().cpu()
    reference = a64.to(dtype).double() @ b64.to(dtype).double()  # the same rounded inputs, exact-ish product
    finite = bool(torch.isfinite(got).all())
    error = float((got - reference).abs().max() / reference.abs().max()) if finite else float("inf")
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    return {
        "dtype": str(dtype).replace("torch.", ""),
        "shape": n,
        "finite": finite,
        "max_rel_error": error,
        "ok": finite and error <= tolerance,
    }
