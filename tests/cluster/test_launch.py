"""Launching: rank discovery per launcher (pure functions over an environment), the sbatch script and mpirun line
that ``anytrain launch`` writes, and a real ``mpirun -n 2`` (Debian's openmpi-bin) training that must give the same
losses as ``torchrun --nproc-per-node 2``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from anytrain.errors import ConfigError
from anytrain.launch.env import discover, expand_hostlist, tasks_on_node
from anytrain.launch.mpi import hostfile_hosts, mpirun_command
from anytrain.launch.slurm import SlurmJob, render_sbatch
from tests.cluster.conftest import missing_tools
from tests.conftest import ROOT, cli_env, cli_in_process


def write_config(tmp_path: Path, data: Path, steps: int) -> Path:
    """The tiny debug model on the small corpus, fp32 on CPU (as tests/distributed use)."""
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(f"""
model: {{arch: transformer, flavour: debug}}
data: {{path: {data}, seq_len: 32}}
train: {{steps: {steps}, global_batch: 8, micro_batch: 2, lr: 3.0e-3, warmup_steps: 2, dtype: fp32, log_interval: 1,
         eval_interval: 0, eval_batches: 1}}
checkpoint: {{save_final: false}}
device: cpu
""")
    return cfg


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if row["kind"] == "train"]


# -- discovery -------------------------------------------------------------------------------------------------------


def test_single_process_without_a_launcher():
    found = discover({"PATH": "/bin"})
    assert (found.launcher, found.rank, found.world_size, found.is_distributed) == ("single", 0, 1, False)


def test_torchrun_wins_even_inside_an_srun_step():
    env = {"TORCHELASTIC_RUN_ID": "x", "RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8",
           "MASTER_ADDR": "n1", "MASTER_PORT": "1234", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0"}  # fmt: skip
    found = discover(env)
    assert (found.launcher, found.rank, found.world_size, found.local_rank, found.master_addr, found.master_port) == (
        "torchrun", 5, 16, 1, "n1", 1234)  # fmt: skip


def slurm_step(**extra: str) -> dict[str, str]:
    env = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
           "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NODELIST": "gpu[07-08]"}  # fmt: skip
    return {**env, **extra}


def test_srun_step_gives_rank_world_local_rank_and_the_first_host():
    found = discover(slurm_step())
    assert (found.launcher, found.rank, found.world_size, found.local_rank, found.local_world_size) == (
        "slurm", 3, 4, 1, 2)  # fmt: skip
    assert found.master_addr == "gpu07" and 15000 <= found.master_port < 35000
    assert discover(slurm_step(SLURM_PROCID="0")).master_port == found.master_port  # every task derives it alike
    assert discover(slurm_step(MASTER_ADDR="head", MASTER_PORT="4242")).master_addr == "head"
    env: dict[str, str] = {}
    found.export(env)
    assert env == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "gpu07", "MASTER_PORT": str(found.master_port)}  # fmt: skip


def test_a_batch_script_without_srun_is_one_process():
    assert discover({"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}).launcher == "single"


@pytest.mark.parametrize("extra, message", [
    ({"WORLD_SIZE": "8"}, "srun: WORLD_SIZE=8 but SLURM_STEP_NUM_TASKS=4; the launchers disagree"),
    ({"RANK": "0"}, "srun: RANK=0 but SLURM_PROCID=3"),
    ({"SLURM_NTASKS": "2"}, "srun: SLURM_NTASKS=2 but SLURM_STEP_NUM_TASKS=4"),
    ({"SLURM_PROCID": "9"}, "slurm: rank 9 is outside world size 4"),
])  # fmt: skip
def test_disagreeing_launchers_are_one_line_errors(extra, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as info:
        discover(slurm_step(**extra))
    assert "\n" not in str(info.value)


def test_open_mpi_on_one_host_and_across_hosts():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "680460289"}  # fmt: skip
    found = discover(env)
    assert (found.launcher, found.rank, found.world_size, found.local_rank, found.master_addr) == (
        "mpi", 1, 2, 1, "127.0.0.1")  # fmt: skip
    with pytest.raises(ConfigError, match="ranks span several hosts but MASTER_ADDR is not set"):
        discover({**env, "OMPI_COMM_WORLD_SIZE": "4"})
    assert discover({**env, "OMPI_COMM_WORLD_SIZE": "4", "MASTER_ADDR": "n0"}).master_addr == "n0"
    # mpirun inside an allocation starts its daemons with srun: MPI's facts win over the daemons' SLURM_*
    assert discover({**slurm_step(), **env}).launcher == "mpi"
    with pytest.raises(ConfigError, match=r"WORLD_SIZE=3 but OMPI_COMM_WORLD_SIZE=2"):
        discover({**env, "WORLD_SIZE": "3"})


def test_mpich_pmi_variables():
    found = discover({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"})
    assert (found.launcher, found.world_size, found.master_addr) == ("mpi", 2, "127.0.0.1")


def test_hostlists_and_tasks_per_node():
    assert expand_hostlist("gpu[01-03,7],login1") == ["gpu01", "gpu02", "gpu03", "gpu7", "login1"]
    assert expand_hostlist("r[1-2]n[8-9]") == ["r1n8", "r1n9", "r2n8", "r2n9"]
    assert expand_hostlist("vm") == ["vm"]
    assert [tasks_on_node("2(x3),1", i) for i in range(4)] == [2, 2, 2, 1]


# -- generated jobs --------------------------------------------------------------------------------------------------


def test_sbatch_script_for_gpu_and_cpu_clusters(tmp_path):
    gpu = render_sbatch(SlurmJob(config="configs/tiny.yaml", run_dir="runs/x", nodes=4, gpus_per_node=8,
                                 partition="gpu", time="01:00:00", vendor="rocm", ifname="hsn0",
                                 workdir=str(tmp_path), overrides=["--train.steps", "9"]))  # fmt: skip
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --time=01:00:00", "#SBATCH --signal=B:TERM@120",
                 "#SBATCH --requeue", f"#SBATCH --output={tmp_path}/runs/slurm-logs/slurm-%j.out",
                 'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
                 'export NCCL_SOCKET_IFNAME="hsn0"', 'export HSA_FORCE_FINE_GRAIN_PCIE="1"',
                 ):  # fmt: skip
        assert line in gpu.splitlines(), line
    assert "--checkpoint.auto_resume true --train.steps 9 &" in gpu and "--device cpu" not in gpu
    assert 'then scontrol requeue "$SLURM_JOB_ID"; fi' in gpu
    cpu = render_sbatch(SlurmJob(config="c.yaml", run_dir="r", tasks_per_node=2, workdir=str(tmp_path)))
    assert "#SBATCH --ntasks-per-node=2" in cpu and "--gpus-per-node" not in cpu and "NCCL" not in cpu
    assert "--device cpu" in cpu
    with pytest.raises(ConfigError, match="--vendor cuda with --gpus-per-node 0"):
        render_sbatch(SlurmJob(config="c.yaml", run_dir="r", vendor="cuda"))
    # the script is valid bash
    (tmp_path / "job.sh").write_text(gpu)
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sh")]).returncode == 0


def test_mpirun_line_takes_the_master_from_the_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode1 slots=8\nnode2:8\n")
    assert hostfile_hosts(str(hostfile)) == ["node1", "node2"]
    cmd = mpirun_command("c.yaml", "runs/r", 16, str(hostfile), gpus_per_node=8, overrides=["--train.steps", "3"])
    assert cmd[:5] == ["mpirun", "-n", "16", "--hostfile", str(hostfile)]
    assert "ppr:8:node" in cmd and "MASTER_ADDR=node1" in cmd and "NCCL_DEBUG=WARN" in cmd
    assert cmd[-2:] == ["--train.steps", "3"] and "--device" not in cmd


# -- a real mpirun ---------------------------------------------------------------------------------------------------


def test_mpirun_two_ranks_match_torchrun(small_data, tmp_path):
    if missing_tools(["mpirun"]):
        pytest.skip("Open MPI not installed (mpirun missing): run tests/cluster/install.sh as root")
    config = write_config(tmp_path, small_data, 5)
    env = cli_env()
    for key in [k for k in env if k.startswith(("SLURM_", "OMPI_", "PMI"))]:
        env.pop(key)
    extra = "--oversubscribe" + (" --allow-run-as-root" if os.geteuid() == 0 else "")
    mpi = subprocess.run([sys.executable, "-m", "anytrain", "launch", "mpi", str(config), "-n", "2", "--execute",
                          "--run-dir", str(tmp_path / "mpi"), "--master-port", str(_free_port()), "--mpirun-args",
                          extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert mpi.returncode == 0, mpi.stdout[-2000:] + mpi.stderr[-3000:]
    torchrun = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               "-m", "anytrain", "train", str(config), "--run-dir", str(tmp_path / "torchrun")],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    assert json.loads((tmp_path / "mpi" / "summary.json").read_text())["world_size"] == 2
    assert losses(tmp_path / "mpi") == losses(tmp_path / "torchrun") and len(losses(tmp_path / "mpi")) == 5


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_launch_slurm_submit_runs_sbatch_and_reports_its_failure(tmp_path, small_data):
    """--submit hands the written script to sbatch (a stand-in here; the real one is in test_slurm.py)."""
    config = write_config(tmp_path, small_data, 3)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "sbatch"
    fake.write_text('#!/bin/sh\n[ -f "$1" ] && grep -q "^#SBATCH --requeue" "$1" && echo "Submitted batch job 42" '
                    '&& exit 0\necho "sbatch: error: Batch job submission failed" >&2; exit 1\n')  # fmt: skip
    fake.chmod(0o755)
    env = cli_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    args = [sys.executable, "-m", "anytrain", "launch", "slurm", str(config), "--run-dir", str(tmp_path / "run"),
            "--submit"]  # fmt: skip
    ok = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "Submitted batch job 42" in ok.stdout, ok.stderr
    assert (tmp_path / "run.sbatch").is_file() and (tmp_path / "slurm-logs").is_dir()
    bad = subprocess.run([*args, "--no-requeue"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "error: sbatch failed (1): sbatch: error: Batch job submission failed" in bad.stderr


def test_launch_slurm_nodes_auto_sizes_the_job_with_the_cost_model(tmp_path, capsys):
    """--nodes auto: the 1.1B recipe's 152,588 steps (1e10 tokens) by a 24 h limit on H200s -> 2 GPUs on one node
    with the planner's layout (docs/cost-model.md, "Job sizing", second example); too short a limit names the flag."""
    args = ["launch", "slurm", str(ROOT / "configs/1.1b.yaml"), "--nodes", "auto", "--gpu", "h200", "--gpus-per-node",
            "8", "--time", "24:00:00", "--run-dir", str(tmp_path / "run"), "--", "--train.steps", "152588"]  # fmt: skip
    code, out, err = cli_in_process(capsys, *args)
    assert code == 0, err
    assert "--nodes auto: 2 devices (dp2 fsdp-noreshard, micro-batch 16, AC none) take 19.0 h" in out
    script = (tmp_path / "run.sbatch").read_text()
    assert "#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=2\n#SBATCH --gpus-per-node=2\n" in script
    assert (
        "--parallel.strategy fsdp --parallel.tp 1 --parallel.pp 1 --parallel.reshard_after_forward false "
        "--train.micro_batch 16 --train.activation_checkpointing none --train.steps 152588 &"
    ) in script
    short = [*args[:10], "01:00:00", "--max-nodes", "1", *args[11:]]
    code, _, err = cli_in_process(capsys, *short)
    assert code == 2 and err.startswith("error: --time: no device count up to --max-nodes 1 finishes in 1.0 h"), err
    code, _, err = cli_in_process(capsys, *args[:5], "--run-dir", str(tmp_path / "x"))
    assert code == 2 and "error: --nodes auto: needs --gpus-per-node N and --gpu KIND" in err
