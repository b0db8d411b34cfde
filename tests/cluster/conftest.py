"""A real one-node SLURM cluster (munged, slurmctld, slurmd from Debian's munge / slurm-wlm) on localhost.

The daemons run in the foreground of processes this fixture starts, with their key, sockets, state, spool, logs and
``slurm.conf`` in a temporary directory and free TCP ports, so parallel test sessions on one machine do not meet.
Clients find the cluster through ``SLURM_CONF``. Teardown stops exactly the three processes it started, by PID.
``tests/cluster/install.sh`` (run by ``make test``) installs the packages where they are missing and we are root.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import cli_env

SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "scontrol")


def missing_tools(tools) -> list[str]:
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    return [tool for tool in tools if shutil.which(tool, path=path) is None]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class SlurmCluster:
    conf: Path
    node: str
    cpus: int

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for SLURM clients (and the tasks they start, which inherit it) of this cluster."""
        env = cli_env()
        for key in [k for k in env if k.startswith(("SLURM_", "OMPI_", "PMI"))]:
            env.pop(key)  # a test session that itself runs inside a SLURM job or under mpirun
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
            env.pop(key, None)
        return {**env, "SLURM_CONF": str(self.conf), **extra}


def _write_conf(root: Path, node: str, cpus: int, user: str) -> Path:
    conf = root / "slurm.conf"
    conf.write_text(f"""ClusterName=anytraintest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.sock,cred_expire=10
SlurmUser={user}
SlurmdUser={user}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
InactiveLimit=0
KillWait=30
MinJobAge=300
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
""")
    return conf


def _wait_idle(env: dict[str, str], procs: list[subprocess.Popen], root: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                logs = "\n".join(p.read_text()[-1500:] for p in root.glob("*.log*") if p.is_file())
                raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}:\n{logs}")
        state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True)
        if state.stdout.strip() in ("idle", "mixed", "allocated"):
            return
        time.sleep(0.2)
    raise RuntimeError(f"slurm node not idle after {timeout_s:.0f} s: {state.stdout.strip()} {state.stderr.strip()}")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    missing = missing_tools(SLURM_TOOLS)
    if missing:
        pytest.skip(
            f"SLURM not installed ({', '.join(missing)} missing): run tests/cluster/install.sh as root "
            "(apt-get install slurm-wlm munge)"
        )
    root = tmp_path_factory.mktemp("slurm")
    root.chmod(0o700)  # munged refuses keys and sockets in directories others can write
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    node, cpus = socket.gethostname().split(".")[0], os.cpu_count() or 1
    conf = _write_conf(root, node, cpus, getpass.getuser())
    cluster = SlurmCluster(conf, node, cpus)
    env = cluster.env()
    sbin = os.pathsep.join(("/usr/sbin", "/sbin", env.get("PATH", "")))
    commands = [
        [
            "munged",
            "-F",
            "-f",
            f"--socket={root}/munge.sock",
            f"--key-file={key}",
            f"--log-file={root}/munged.log",
            f"--pid-file={root}/munged.pid",
            f"--seed-file={root}/munged.seed",
        ],
        ["slurmctld", "-D", "-c", "-f", str(conf)],
        ["slurmd", "-D", "-f", str(conf), "-N", node],
    ]
    procs: list[subprocess.Popen] = []
    try:
        for cmd in commands:
            exe = shutil.which(cmd[0], path=sbin)
            log = open(root / f"{cmd[0]}.out", "w")  # noqa: SIM115 - the daemon holds it until teardown
            procs.append(subprocess.Popen([exe, *cmd[1:]], env=env, stdout=log, stderr=subprocess.STDOUT))
            if cmd[0] == "munged":
                _wait_for(root / "munge.sock", procs[-1])
        _wait_idle(env, procs, root)
        yield cluster
    finally:
        for proc in reversed(procs):  # only the processes started above, by PID
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"munged did not create {path} (exit {proc.poll()})")
        time.sleep(0.05)
