"""Collective-library environment per vendor for generated job scripts and mpirun lines.

The submitting host often has no GPU, so the vendor is the user's choice (``--vendor``), named with hardware's
constants. The variables are the libraries' own (NCCL on NVIDIA; RCCL on AMD reads the same NCCL_* names; gloo on
CPU) and only what a first multi-node run needs: errors surfaced as exceptions instead of hangs, warnings in the job
log, and the socket interface when the user names one. Inside each process ``hardware.apply_env_defaults`` adds the
per-vendor PyTorch defaults.
"""

from __future__ import annotations

from anytrain.hardware import CPU, CUDA, ROCM

VENDORS = (CUDA, ROCM, CPU)


def collective_env(vendor: str, ifname: str = "") -> dict[str, str]:
    """Environment variables for one vendor's collective library (``ifname``: socket interface, e.g. ib0 / hsn0)."""
    if vendor == CPU:
        return {"GLOO_SOCKET_IFNAME": ifname} if ifname else {}
    env = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # a failed or stuck collective raises instead of hanging the job
        "NCCL_DEBUG": "WARN",
    }
    if vendor == ROCM:
        # RCCL on MI200/MI300 nodes: fine-grained PCIe memory for peer transfers, and a per-node MIOpen cache
        # (the default one on a shared file system is a known source of lock contention across nodes).
        env["HSA_FORCE_FINE_GRAIN_PCIE"] = "1"
        env["MIOPEN_USER_DB_PATH"] = "/tmp/miopen-${USER}-${SLURM_JOB_ID:-0}"
    if ifname:
        env["NCCL_SOCKET_IFNAME"] = ifname
        env["GLOO_SOCKET_IFNAME"] = ifname
    return env
