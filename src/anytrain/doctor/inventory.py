"""What one rank can see of its host: CPUs, memory, accelerators, driver and toolkit versions, the SLURM allocation,
network interfaces; and a GEMM checked against a float64 reference (NaN / wrong-result detection)."""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
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


def driver_versions(vendor: str) -> dict:
    """GPU driver and toolkit versions: nvidia-smi's driver on NVIDIA, the ROCm release on AMD (None where absent)."""
    if vendor == hardware.CUDA:
        return {"driver": _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])}
    if vendor == hardware.ROCM:
        info = Path("/opt/rocm/.info/version")
        return {"driver": _run(["cat", "/sys/module/amdgpu/version"]),
                "rocm": info.read_text().strip() if info.is_file() else None}  # fmt: skip
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


def slurm_allocation(env: dict[str, str] | None = None) -> dict | None:
    """The SLURM job this process runs in (None outside SLURM)."""
    env = dict(os.environ) if env is None else env
    if "SLURM_JOB_ID" not in env:
        return None
    keys = {"job_id": "SLURM_JOB_ID", "partition": "SLURM_JOB_PARTITION", "nodelist": "SLURM_JOB_NODELIST",
            "nodes": "SLURM_JOB_NUM_NODES", "tasks": "SLURM_NTASKS", "gpus_on_node": "SLURM_GPUS_ON_NODE",
            "cpus_on_node": "SLURM_CPUS_ON_NODE", "step_id": "SLURM_STEP_ID"}  # fmt: skip
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
    return {"dtype": str(dtype).replace("torch.", ""), "shape": n, "finite": finite, "max_rel_error": error,
            "ok": finite and error <= tolerance}  # fmt: skip
