"""``anytrain launch mpi``: the Open MPI ``mpirun`` command line for a training run.

MPI starts the processes; torch.distributed still forms its own group (gloo / NCCL / RCCL) from the rank facts MPI
exports (``anytrain.parallel.env``). MPI does not say which host rank 0 is on, so the line passes MASTER_ADDR (the
first host of the hostfile, or 127.0.0.1 without one) and MASTER_PORT with ``-x``, along with the vendor's collective
environment. ``--bind-to none``: Open MPI binds each rank to one core by default, which would leave PyTorch's intra-op
threads one core (``parallel.cpu_affinity: cores`` is the binding anytrain offers).
"""

from __future__ import annotations

import getpass
import os
import re
import shlex
import sys
from pathlib import Path

from anytrain.errors import ConfigError
from anytrain.launch.vendor import VENDORS, check_ifname, collective_env

# a host name or address as a hostfile gives it (``user@`` allowed): nothing a shell or ssh would read as more
HOST_NAME = re.compile(r"([A-Za-z0-9_][A-Za-z0-9._-]*@)?[A-Za-z0-9_][A-Za-z0-9._-]*")


def hostfile_hosts(path: str) -> list[str]:
    """Hosts of an Open MPI / MPICH hostfile in order (``host slots=4``, ``host:4``, comments and blank lines)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"--hostfile: cannot read {path}: {exc.strerror}") from None
    hosts = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if line:
            host = line.split()[0].split(":")[0]
            if not HOST_NAME.fullmatch(host):
                raise ConfigError(
                    f"--hostfile: {path} line {number}: {host!r} is not a host name (letters, digits, '.', '-', '_', "
                    "optionally user@); correct the hostfile"
                )
            hosts.append(host)
    if not hosts:
        raise ConfigError(f"--hostfile: {path} names no host")
    return hosts


def mpirun_command(
    config: str,
    run_dir: str,
    processes: int,
    hostfile: str = "",
    gpus_per_node: int = 0,
    vendor: str = "auto",
    master_port: int = 29500,
    ifname: str = "",
    mpirun_args: str = "",
    overrides: list[str] | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The mpirun argument list (``processes`` ranks; ``gpus_per_node`` > 0 places that many per host)."""
    if processes < 1:
        raise ConfigError("launch mpi: -n must be >= 1")
    vendor = vendor if vendor != "auto" else ("cuda" if gpus_per_node > 0 else "cpu")
    if vendor not in VENDORS:
        raise ConfigError(f"--vendor: expected auto, {', '.join(VENDORS)}; got {vendor!r}")
    check_ifname(ifname)
    master = hostfile_hosts(hostfile)[0].rpartition("@")[2] if hostfile else "127.0.0.1"
    cmd = ["mpirun", "-n", str(processes)]
    if hostfile:
        cmd += ["--hostfile", hostfile]
    if gpus_per_node > 0:
        cmd += ["--map-by", f"ppr:{gpus_per_node}:node"]
    cmd += ["--bind-to", "none", *shlex.split(mpirun_args)]
    # no shell reads -x values: the MIOpen cache is named with plain values (this user, the rendezvous port)
    vendor_env = collective_env(vendor, ifname, user=_user(), job=str(master_port))
    env = {"MASTER_ADDR": master, "MASTER_PORT": str(master_port), **vendor_env}
    for key, value in env.items():
        cmd += ["-x", f"{key}={value}"]
    for key in ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "OMP_NUM_THREADS"):  # the caller's, where set
        if key in os.environ:
            cmd += ["-x", key]
    cmd += [python, "-m", "anytrain", "train", str(Path(config).resolve()), "--run-dir", str(Path(run_dir).resolve())]
    if vendor == "cpu":
        cmd += ["--device", "cpu"]
    return cmd + list(overrides or [])


def _user() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no login name and no passwd entry (some containers)
        return str(os.getuid())
