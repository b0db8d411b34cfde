"""Collective-library environment per vendor for generated job scripts and mpirun lines.

The submitting host often has no GPU, so the vendor is the user's choice (``--vendor``), named with hardware's
constants. The variables are the libraries' own (NCCL on NVIDIA; RCCL on AMD reads the same NCCL_* names; gloo on
CPU) and only what a first multi-node run needs: errors surfaced as exceptions instead of hangs, warnings in the job
log, and the socket interface when the user names one. Inside each process ``hardware.apply_env_defaults`` adds the
per-vendor PyTorch defaults.
"""

from __future__ import annotations

from anytrain.errors import ConfigError
from anytrain.hardware import CPU, CUDA, ROCM
from anytrain.launch.recipe import control_char

VENDORS = (CUDA, ROCM, CPU)
SHELL_EXPANDED = frozenset({"MIOPEN_USER_DB_PATH"})
"""Variables whose default value holds ``${...}`` for the job's shell to expand (constants of this module, never a
user's value); a script writes them in double quotes, every other value single-quoted."""


def collective_env(
    vendor: str, ifname: str = "", user: str = "${USER}", job: str = "${SLURM_JOB_ID:-0}"
) -> dict[str, str]:
    """Environment variables for one vendor's collective library (``ifname``: socket interface, e.g. ib0 / hsn0).
    ``user`` and ``job`` name the per-job MIOpen cache on ROCm: shell expansions for a job script by default, plain
    values where no shell reads the environment (mpirun ``-x``)."""
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
        env["MIOPEN_USER_DB_PATH"] = f"/tmp/miopen-{user}-{job}"
    if ifname:
        env["NCCL_SOCKET_IFNAME"] = ifname
        env["GLOO_SOCKET_IFNAME"] = ifname
    return env


def check_ifname(ifname: str) -> None:
    """``--ifname`` as the libraries read it (names or NCCL's prefix list, ``^`` / ``=`` included): no whitespace or
    control characters, which no interface name holds."""
    if control_char(ifname) is not None or any(ch.isspace() for ch in ifname):
        raise ConfigError(
            f"--ifname: {ifname!r} holds a space or a control character; give interface names (or NCCL's prefix "
            "list, e.g. ib0 or ^docker,lo) without them"
        )
