"""Launching: rank discovery per launcher (pure functions over an environment), the sbatch script and mpirun line
that ``anytrain launch`` writes, and a real ``mpirun -n 2`` (Debian's openmpi-bin) training that must give the same
losses as ``torchrun --nproc-per-node 2``."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from anytrain.errors import ConfigError
from anytrain.launch.mpi import hostfile_hosts, mpirun_command
from anytrain.launch.slurm import SlurmJob, render_sbatch
from anytrain.parallel.env import discover, expand_hostlist, tasks_on_node
from tests.cluster.conftest import missing_tools
from tests.conftest import ROOT, cli_env, cli_in_process, run_cli


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
    env = {
        "TORCHELASTIC_RUN_ID": "x",
        "RANK": "5",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "8",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "1234",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_PROCID": "0",
    }
    found = discover(env)
    assert (found.launcher, found.rank, found.world_size, found.local_rank, found.master_addr, found.master_port) == (
        "torchrun",
        5,
        16,
        1,
        "n1",
        1234,
    )


def slurm_step(**extra: str) -> dict[str, str]:
    env = {
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
    }
    return {**env, **extra}


def test_srun_step_gives_rank_world_local_rank_and_the_first_host():
    found = discover(slurm_step())
    assert (found.launcher, found.rank, found.world_size, found.local_rank, found.local_world_size) == (
        "slurm",
        3,
        4,
        1,
        2,
    )
    assert found.master_addr == "gpu07" and 15000 <= found.master_port < 35000
    assert discover(slurm_step(SLURM_PROCID="0")).master_port == found.master_port  # every task derives it alike
    assert discover(slurm_step(MASTER_ADDR="head", MASTER_PORT="4242")).master_addr == "head"
    env: dict[str, str] = {}
    found.export(env)
    assert env == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(found.master_port),
    }


def test_a_batch_script_without_srun_is_one_process():
    assert discover({"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}).launcher == "single"


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"WORLD_SIZE": "8"}, "srun: WORLD_SIZE=8 but SLURM_STEP_NUM_TASKS=4; the launchers disagree"),
        ({"RANK": "0"}, "srun: RANK=0 but SLURM_PROCID=3"),
        ({"SLURM_NTASKS": "2"}, "srun: SLURM_NTASKS=2 but SLURM_STEP_NUM_TASKS=4"),
        ({"SLURM_PROCID": "9"}, "slurm: rank 9 is outside world size 4"),
    ],
)
def test_disagreeing_launchers_are_one_line_errors(extra, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as info:
        discover(slurm_step(**extra))
    assert "\n" not in str(info.value)


def test_open_mpi_on_one_host_and_across_hosts():
    env = {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "OMPI_MCA_ess_base_jobid": "680460289",
    }
    found = discover(env)
    assert (found.launcher, found.rank, found.world_size, found.local_rank, found.master_addr) == (
        "mpi",
        1,
        2,
        1,
        "127.0.0.1",
    )
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
    gpu = render_sbatch(
        SlurmJob(
            config="configs/tiny.yaml",
            run_dir="runs/x",
            nodes=4,
            gpus_per_node=8,
            partition="gpu",
            time="01:00:00",
            vendor="rocm",
            ifname="hsn0",
            workdir=str(tmp_path),
            overrides=["--train.steps", "9"],
        )
    )
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        '#SBATCH --partition="gpu"',
        '#SBATCH --time="01:00:00"',
        "#SBATCH --signal=B:TERM@120",
        "#SBATCH --requeue",
        f'#SBATCH --output="{tmp_path}/runs/slurm-logs/slurm-%j.out"',
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        "export NCCL_SOCKET_IFNAME=hsn0",
        "export HSA_FORCE_FINE_GRAIN_PCIE=1",
        'export MIOPEN_USER_DB_PATH="/tmp/miopen-${USER}-${SLURM_JOB_ID:-0}"',
    ):
        assert line in gpu.splitlines(), line
    assert "--checkpoint.auto_resume true --train.steps 9\n" in gpu and "--device cpu" not in gpu
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


def test_mpirun_two_ranks_match_torchrun(small_data, tmp_path, capfd, monkeypatch):
    if missing_tools(["mpirun"]):
        pytest.skip("Open MPI not installed (mpirun missing): run tests/cluster/install.sh as root")
    config = write_config(tmp_path, small_data, 5)
    for key in [k for k in os.environ if k.startswith(("SLURM_", "OMPI_", "PMI"))]:
        monkeypatch.delenv(key)
    for key, value in cli_env().items():  # what mpirun passes on to the ranks (PYTHONPATH, OMP_NUM_THREADS, ...)
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MPIEXEC_TIMEOUT", "300")  # Open MPI's own limit: a hung rank fails the test, as a timeout would
    extra = "--oversubscribe" + (" --allow-run-as-root" if os.geteuid() == 0 else "")
    # the verb in this process (no interpreter start-up of its own); mpirun and its two ranks are real processes
    code, out, err = cli_in_process(
        capfd,
        "launch",
        "mpi",
        str(config),
        "-n",
        "2",
        "--execute",
        "--run-dir",
        str(tmp_path / "mpi"),
        "--master-port",
        str(_free_port()),
        "--mpirun-args",
        extra,
    )
    assert code == 0, out[-2000:] + err[-3000:]
    # the reference: two ranks with torchrun's launch variables (forks of the pre-imported CLI: tests/forklaunch.py;
    # torchrun's own agent is exercised by tests/distributed/test_preemption.py and the kill tests)
    reference = run_cli("train", str(config), "--run-dir", str(tmp_path / "reference"), nproc=2, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert json.loads((tmp_path / "mpi" / "summary.json").read_text())["world_size"] == 2
    assert losses(tmp_path / "mpi") == losses(tmp_path / "reference") and len(losses(tmp_path / "mpi")) == 5


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_launch_slurm_submit_runs_sbatch_and_reports_its_failure(tmp_path, small_data, capsys, monkeypatch):
    """--submit hands the written script to sbatch (a stand-in here; the real one is in test_slurm.py)."""
    config = write_config(tmp_path, small_data, 3)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "sbatch"
    fake.write_text(
        '#!/bin/sh\n[ -f "$1" ] && grep -q "^#SBATCH --requeue" "$1" && echo "Submitted batch job 42" '
        '&& exit 0\necho "sbatch: error: Batch job submission failed" >&2; exit 1\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")  # the verb runs in this process
    args = ["launch", "slurm", str(config), "--run-dir", str(tmp_path / "run"), "--submit"]
    code, out, err = cli_in_process(capsys, *args)
    assert code == 0 and "Submitted batch job 42" in out, err
    assert (tmp_path / "run.sbatch").is_file() and (tmp_path / "slurm-logs").is_dir()
    code, _, err = cli_in_process(capsys, *args, "--no-requeue")
    assert code == 2 and "error: sbatch failed (1): sbatch: error: Batch job submission failed" in err


def test_launch_slurm_nodes_auto_sizes_the_job_with_the_cost_model(tmp_path, capsys):
    """--nodes auto: the 1.1B recipe's 152,588 steps (1e10 tokens) by a 24 h limit on H200s -> 2 GPUs on one node
    with the planner's layout (docs/cost-model.md, "Job sizing", second example); too short a limit names the flag."""
    args = [
        "launch",
        "slurm",
        str(ROOT / "configs/1.1b.yaml"),
        "--nodes",
        "auto",
        "--gpu",
        "h200",
        "--gpus-per-node",
        "8",
        "--time",
        "24:00:00",
        "--run-dir",
        str(tmp_path / "run"),
        "--",
        "--train.steps",
        "152588",
    ]
    code, out, err = cli_in_process(capsys, *args)
    assert code == 0, err
    assert "--nodes auto: 2 devices (dp2 fsdp-noreshard, micro-batch 16, AC none) take 19.0 h" in out
    script = (tmp_path / "run.sbatch").read_text()
    assert "#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=2\n#SBATCH --gpus-per-node=2\n" in script
    assert (
        "--parallel.strategy fsdp --parallel.tp 1 --parallel.pp 1 --parallel.reshard_after_forward false "
        "--parallel.tp_sequence_loss false --train.micro_batch 16 --train.activation_checkpointing none "
        "--train.steps 152588\n"
    ) in script
    short = [*args[:10], "01:00:00", "--max-nodes", "1", *args[11:]]
    code, _, err = cli_in_process(capsys, *short)
    assert code == 2 and err.startswith("error: --time: no device count up to --max-nodes 1 finishes in 1.0 h"), err
    code, _, err = cli_in_process(capsys, *args[:5], "--run-dir", str(tmp_path / "x"))
    assert code == 2 and "error: --nodes auto: needs --gpus-per-node N and --gpu KIND" in err


# -- values that reach a script: quoted or refused -------------------------------------------------------------------

# A command the hostile values below would run if a shell or sbatch read them as code: it creates OWNED in the working
# directory (the tests run the CLI and the script in tmp_path).
OWNED = "owned"
INJECT = f"$(touch {OWNED})"
INJECT_NO_SPACE = f"$(touch${{IFS}}{OWNED})`touch${{IFS}}{OWNED}`"  # for --ifname, which refuses whitespace


def hostile_config(tmp_path: Path, data: Path, steps: int = 3) -> Path:
    """The small-corpus recipe in a folder whose name holds newlines, a command substitution, quotes and spaces."""
    folder = tmp_path / f"c\ntouch {OWNED}\n#" / f"x {INJECT} 'q\"`touch {OWNED}`"
    folder.mkdir(parents=True)
    config = folder / "my cfg.yaml"
    config.write_text(write_config(tmp_path, data, steps).read_text())
    return config


HOSTILE_RUN_DIR = f"r {INJECT} 'q\"%x/run"  # a space, a substitution, both quotes, a % (SLURM's --output pattern)
HOSTILE_JOB_NAME = f'j {INJECT} "q" #x'


def launch_cli(capsys, monkeypatch, cwd: Path, *args: str) -> tuple[int, str, str]:
    monkeypatch.chdir(cwd)
    return cli_in_process(capsys, "launch", "slurm", *args)


def test_hostile_paths_and_values_stay_literal_when_bash_runs_the_script(tmp_path, small_data, capsys, monkeypatch):
    """The whole written script under real bash (srun and scontrol find no cluster, so it ends at the first srun):
    nothing a config folder, run directory, job name, partition or --ifname holds is run; the exported values and the
    training's arguments are literal."""
    config = hostile_config(tmp_path, small_data)
    ifname = f"lo{INJECT_NO_SPACE}'\""
    args = [str(config), "-N", "1", "-G", "1", "--run-dir", HOSTILE_RUN_DIR, "--job-name", HOSTILE_JOB_NAME]
    code, out, err = launch_cli(capsys, monkeypatch, tmp_path, *args, "--partition", f"p{INJECT}", "--ifname", ifname)
    assert code == 0, err
    script = tmp_path / (HOSTILE_RUN_DIR + ".sbatch")
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    (tmp_path / "empty.conf").write_text("")  # SLURM's clients stop at once on it ("ClusterName needs to be specified")
    env = {
        **cli_env(),
        "SLURM_CONF": str(tmp_path / "empty.conf"),
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_JOB_NUM_NODES": "1",
    }
    ran = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert ran.returncode != 0 and "anytrain: job 7 (restart 0)" in ran.stdout, ran.stdout + ran.stderr
    assert not list(tmp_path.rglob(OWNED)), "an injected command ran"
    exports = [line for line in script.read_text().splitlines() if line.startswith("export ") and "IFNAME=" in line]
    shown = subprocess.run(
        ["bash", "-c", "\n".join([*exports, 'printf "%s|%s" "$NCCL_SOCKET_IFNAME" "$GLOO_SOCKET_IFNAME"'])],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert shown.stdout == f"{ifname}|{ifname}" and not list(tmp_path.rglob(OWNED)), shown.stderr
    text = script.read_text()  # the training's command as bash reads it (it spans lines: the path holds newlines)
    start = text.index("\nrun_step ") + 1
    train = text[start : text.index("\nif [", start)]
    back = subprocess.run(
        ["bash", "-c", f'run_step() {{ printf "%s\\0" "$@"; }}\n{train}'], cwd=tmp_path, capture_output=True, text=True
    )
    argv = back.stdout.split("\0")
    assert argv[argv.index("train") + 1] == str(config)
    assert argv[argv.index("--run-dir") + 1] == str(tmp_path / HOSTILE_RUN_DIR)


@pytest.mark.parametrize(
    "args, line",
    [
        (["--job-name", "a\nb"], "error: --job-name: 'a\\nb' holds a control character ('\\n')"),
        (["--partition", f"gpu\ntouch {OWNED}"], "error: --partition: 'gpu\\ntouch owned' holds a control character"),
        (["--account", "a\rb"], "error: --account: 'a\\rb' holds a control character ('\\r')"),
        (["--time", f"01:00:00\ntouch {OWNED}"], "error: --time: expected minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or"),
        (["--time", f"1:00{INJECT}"], "error: --time: expected minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or"),
        (["--run-dir", f"a\ntouch {OWNED}\n#/run"], "error: --run-dir: the job log folder"),
        (["--run-dir", "a\\b/run"], "error: --run-dir: the job log folder"),
        (["--ifname", "ib0\nib1"], "error: --ifname: 'ib0\\nib1' holds a space or a control character"),
    ],
)
def test_values_a_script_cannot_hold_are_one_line_errors_and_nothing_is_written(
    tmp_path, small_data, capsys, monkeypatch, args, line
):
    config = write_config(tmp_path, small_data, 3)
    before = sorted(tmp_path.rglob("*"))
    code, out, err = launch_cli(capsys, monkeypatch, tmp_path, str(config), "--dry-run", *args)
    assert code == 2 and err.startswith(line) and err.count("\n") == 1, err
    assert sorted(tmp_path.rglob("*")) == before and "wrote" not in out


def test_script_overwrites_only_its_own_file_and_never_the_config(tmp_path, small_data, capsys, monkeypatch):
    config = write_config(tmp_path, small_data, 3)
    foreign = tmp_path / "notes.sh"
    foreign.write_text("#!/bin/sh\necho mine\n")
    args = [str(config), "--dry-run", "--run-dir", "run", "--script"]
    code, _, err = launch_cli(capsys, monkeypatch, tmp_path, *args, str(foreign))
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --script: {foreign} exists and was not written by anytrain launch slurm; "), err
    assert foreign.read_text() == "#!/bin/sh\necho mine\n" and not (tmp_path / "slurm-logs").exists()
    for target in (config, Path(os.path.relpath(config, tmp_path))):  # the config itself, also by another name
        code, _, err = launch_cli(capsys, monkeypatch, tmp_path, *args, str(target), "--overwrite")
        assert (
            code == 2
            and err.startswith(f"error: --script: {target} is the config file; ")
            and "--overwrite" not in err.split(";")[1]
        ), err
    assert "model:" in config.read_text()
    hostile = hostile_config(tmp_path, small_data)  # its path in the message stays on one line
    code, _, err = launch_cli(capsys, monkeypatch, tmp_path, str(hostile), *args[1:], str(hostile), "--overwrite")
    assert code == 2 and err.startswith(f"error: --script: {str(hostile)!r} is the config file; "), err
    assert err.count("\n") == 1
    assert "model:" in hostile.read_text()
    code, _, err = launch_cli(capsys, monkeypatch, tmp_path, *args, str(tmp_path))
    assert code == 2 and err.startswith(f"error: --script: {tmp_path} is a folder"), err
    code, out, err = launch_cli(capsys, monkeypatch, tmp_path, *args, str(foreign), "--overwrite")
    assert code == 0 and "#SBATCH --requeue" in foreign.read_text(), err
    own = tmp_path / "run.sbatch"  # the default --script; our own file is rewritten without --overwrite
    for tasks in ("1", "2"):
        code, _, err = launch_cli(capsys, monkeypatch, tmp_path, *args[:-1], "--tasks-per-node", tasks)
        assert code == 0, err
    assert "#SBATCH --ntasks-per-node=2" in own.read_text()


def test_mpi_hostfile_names_that_are_not_hosts_are_one_line_errors(tmp_path, small_data, capsys, monkeypatch):
    config = write_config(tmp_path, small_data, 3)
    monkeypatch.chdir(tmp_path)
    for host in ("node$(reboot)", "node1;reboot", "'node1'", "node`x`", "n|x"):
        hostfile = tmp_path / "hosts"
        hostfile.write_text(f"# cluster\n{host} slots=8\nnode2\n")
        code, out, err = cli_in_process(capsys, "launch", "mpi", str(config), "-n", "2", "--hostfile", str(hostfile))
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert err.startswith(f"error: --hostfile: {hostfile} line 2: {host!r} is not a host name"), err
    assert not list(tmp_path.rglob(OWNED))


def test_mpi_line_is_one_shell_command_with_every_value_literal(tmp_path, small_data, capsys, monkeypatch):
    """The printed mpirun line, read back by real bash (``printf`` in place of mpirun), gives back the same argv."""
    config = hostile_config(tmp_path, small_data)
    monkeypatch.chdir(tmp_path)
    args = [
        str(config),
        "-n",
        "2",
        "--vendor",
        "rocm",
        "--ifname",
        f"lo{INJECT_NO_SPACE}",
        "--run-dir",
        HOSTILE_RUN_DIR,
    ]
    code, out, err = cli_in_process(capsys, "launch", "mpi", *args)
    assert code == 0, err
    line = out.rstrip("\n")
    assert line.startswith("mpirun ")
    back = subprocess.run(
        ["bash", "-c", "printf '%s\\0' " + line[len("mpirun ") :]], cwd=tmp_path, capture_output=True, text=True
    )
    argv = back.stdout.split("\0")[:-1]
    assert argv == shlex.split(line)[1:] and not list(tmp_path.rglob(OWNED)), back.stderr
    assert f"GLOO_SOCKET_IFNAME=lo{INJECT_NO_SPACE}" in argv and str(config) in argv
    miopen = next(a for a in argv if a.startswith("MIOPEN_USER_DB_PATH="))
    assert "$" not in miopen  # mpirun -x passes values as they are: no shell expands them
