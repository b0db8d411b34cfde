"""Checkpoints that lose nothing, with real processes on gloo: hard crash, resharding, torn writes, SIGTERM, NaN."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.conftest import ROOT, cli_env, run_cli


def write_config(tmp: Path, data: Path, steps: int, interval: int, log_interval: int = 1, **train: object) -> Path:
    extra = "".join(f"  {k}: {json.dumps(v)}\n" for k, v in train.items())
    cfg = tmp / f"ft-{steps}-{interval}-{log_interval}.yaml"
    cfg.write_text(f"""
model: {{arch: transformer, flavour: debug}}
data: {{path: {data}, seq_len: 32}}
train:
  steps: {steps}
  global_batch: 8
  micro_batch: 2
  lr: 3.0e-3
  warmup_steps: 3
  dtype: fp32
  log_interval: {log_interval}
  eval_interval: 0
  eval_batches: 0
  log_sample_ids: true
{extra}checkpoint: {{interval: {interval}, keep_last: 3}}
device: cpu
""")
    return cfg


def command(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "anytrain"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "anytrain",
    ]


def train(
    config: Path,
    run_dir: Path,
    nproc: int = 2,
    *extra: str,
    expect_ok: bool = True,
    torchrun: bool | None = None,
    **env: str,
):
    argv = ("train", str(config), "--run-dir", str(run_dir), *extra)
    proc = run_cli(*argv, nproc=nproc, timeout=300, torchrun=torchrun, **env)
    if expect_ok:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def step_losses(run_dir: Path) -> dict[int, float]:
    """Loss per step; a step logged twice (before a crash and after the resume) keeps its last value."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            out[record["step"]] = record["loss"]
    return out


def consumed(run_dir: Path, world: int) -> list[int]:
    """Global sample ids in training order, from the per-rank logs."""
    per_rank = []
    for rank in range(world):
        rows = [json.loads(x) for x in (run_dir / f"samples_rank{rank}.jsonl").read_text().splitlines()]
        per_rank.append({row["step"]: row["ids"] for row in rows})
    steps = sorted(per_rank[0])
    assert all(sorted(p) == steps for p in per_rank)
    return [i for s in steps for rank in range(world) for i in per_rank[rank][s]]


def train_state(checkpoint: Path, tmp: Path) -> dict:
    """A DCP checkpoint's whole train state (model, optimizer, scheduler, progress, RNG) as plain tensors."""
    out = tmp / f"{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=False)["train"]


def weights(checkpoint: Path, tmp: Path) -> dict[str, torch.Tensor]:
    return train_state(checkpoint, tmp)["model"]


def assert_same_weights(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if atol == 0.0:
            assert torch.equal(a[key], b[key]), key
        else:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=atol)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_data):
    """An uninterrupted 2-process DDP run of 20 steps, checkpointing every 5."""
    tmp = tmp_path_factory.mktemp("ft")
    config = write_config(tmp, small_data, steps=20, interval=5)
    train(config, tmp / "reference")
    return tmp, config


def test_kill_9_of_one_rank_then_resume_is_exact(reference):
    tmp, config = reference
    run = tmp / "crashed"
    proc = train(config, run, 2, expect_ok=False, ANYTRAIN_TEST_KILL_AT_STEP="12", ANYTRAIN_TEST_KILL_RANK="1")
    assert proc.returncode != 0
    assert max(step_losses(run)) == 11  # steps 1..11 ran, then rank 1 died hard
    proc = train(config, run, 2, "--resume")
    assert "resumed from" in proc.stderr and "step_00000010" in proc.stderr
    ref, resumed = step_losses(tmp / "reference"), step_losses(run)
    assert sorted(resumed) == list(range(1, 21))
    for step in range(11, 21):
        assert resumed[step] == ref[step], step  # bitwise, CPU fp32
    assert_same_weights(
        weights(run / "checkpoints/step_00000020", tmp), weights(tmp / "reference/checkpoints/step_00000020", tmp)
    )
    ids, ref_ids = consumed(run, 2), consumed(tmp / "reference", 2)
    assert ids == ref_ids and len(ids) == 20 * 8  # every global sample once, in order: 0 duplicates, 0 skips


@pytest.mark.slow  # resharding is also covered by test_model_parallel (dp2 x tp2 -> dp4) and test_pipeline
def test_reshard_fsdp2_to_world_1_and_4_and_ddp(tmp_path, small_data):
    config = write_config(tmp_path, small_data, steps=20, interval=10, log_sample_ids=False)
    ref = tmp_path / "fsdp2"
    train(config, ref, 2, "--parallel.strategy", "fsdp", "--checkpoint.async_save", "true")
    assert (ref / "checkpoints/step_00000010/COMMITTED").is_file()
    ref_losses = step_losses(ref)
    for name, nproc, strategy in (("world1", 1, "fsdp"), ("world4", 4, "fsdp"), ("ddp2", 2, "ddp")):
        run = tmp_path / name
        shutil.copytree(ref, run)
        shutil.rmtree(run / "checkpoints/step_00000020")
        proc = train(config, run, nproc, "--resume", "--parallel.strategy", strategy)
        assert "step_00000010" in proc.stderr
        losses = step_losses(run)
        for step in range(11, 21):
            assert abs(losses[step] - ref_losses[step]) <= 1e-6, (name, step, losses[step], ref_losses[step])


def test_torn_checkpoint_is_skipped_with_a_warning(tmp_path, small_data):
    config = write_config(tmp_path, small_data, steps=12, interval=5, log_sample_ids=False)
    run = tmp_path / "torn"
    train(config, run, 1, "--train.stop_at_step", "10")
    (run / "checkpoints/step_00000010/COMMITTED").unlink()
    proc = train(config, run, 1, "--resume")
    assert "skipping" in proc.stderr and "step_00000010" in proc.stderr
    assert "resumed from" in proc.stderr and "step_00000005 (step 5)" in proc.stderr
    resume_records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resume_records if r["kind"] == "resume"] == [5]


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        if (run_dir / "metrics.jsonl").exists() and max(step_losses(run_dir) or {0: 0}) >= step:
            return
        time.sleep(0.05)
    raise AssertionError("training did not reach the step in time")


def _worker_pid(parent: int, rank: int) -> int:
    for child in subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split():
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(child)
    raise AssertionError("worker not found")


# all cases slow: make test covers SIGTERM's save of the current step with test_preemption (torchrun forwards the
# signal; 0 steps lost, requeued resume), the bitwise resume with test_kill_9_of_one_rank_then_resume_is_exact, and the
# lagged checks with test_lagged_checks_stop_a_nan_step_with_the_state_before_it ("fused": the lagged checks)
@pytest.mark.parametrize(
    "nproc,impl",
    [
        pytest.param(1, "auto", marks=pytest.mark.slow),
        pytest.param(2, "auto", marks=pytest.mark.slow),
        pytest.param(2, "fused", marks=pytest.mark.slow),
    ],
)
def test_sigterm_saves_the_current_step_and_resume_is_exact(tmp_path, small_data, nproc, impl):
    # many slow-ish steps so the signal lands mid-run; the schedule is fixed by train.steps
    config = write_config(tmp_path, small_data, steps=100_000, interval=0, log_sample_ids=False, optimizer_impl=impl)
    run = tmp_path / "preempted"
    proc = subprocess.Popen(
        [*command(nproc), "train", str(config), "--run-dir", str(run)],
        cwd=ROOT,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for_step(run, random.randint(3, 12), proc)
    target = proc.pid if nproc == 1 else _worker_pid(proc.pid, 1)  # any rank: here the non-coordinator
    os.kill(target, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    if nproc == 1:
        assert proc.returncode == 143, err[-2000:]
    else:
        assert proc.returncode != 0 and "exit 143" in err
    committed = [p for p in (run / "checkpoints").iterdir() if (p / "COMMITTED").is_file()]
    assert len(committed) == 1
    step = int(committed[0].name.split("_")[1])
    assert step == max(step_losses(run))  # the checkpoint is the last step that ran: 0 steps lost
    train(config, run, nproc, "--resume", "--train.stop_at_step", str(step + 3))
    ref = tmp_path / "uninterrupted"
    train(config, ref, nproc, "--train.stop_at_step", str(step + 3))
    resumed, expected = step_losses(run), step_losses(ref)
    for s in range(1, step + 4):
        assert resumed[s] == expected[s], s


def test_nan_on_one_rank_stops_every_rank_before_the_update(reference):
    tmp, config = reference
    run = tmp / "nan"
    proc = train(config, run, 2, expect_ok=False, ANYTRAIN_TEST_NAN_AT_STEP="7", ANYTRAIN_TEST_NAN_RANK="1")
    assert proc.returncode != 0
    assert proc.stderr.count("step 7: non-finite loss or gradient norm") == 2  # both ranks stop, same verdict
    assert max(step_losses(run)) == 6
    saved = sorted(p.name for p in (run / "checkpoints").iterdir() if (p / "COMMITTED").is_file())
    assert saved == ["step_00000005", "step_00000006"]  # no checkpoint of a NaN state
    ref_weights = tmp / "ref-step6"
    train(config, ref_weights, 2, "--train.stop_at_step", "6")
    assert_same_weights(
        weights(run / "checkpoints/step_00000006", tmp), weights(ref_weights / "checkpoints/step_00000006", tmp)
    )
    for tensor in weights(run / "checkpoints/step_00000006", tmp).values():
        assert torch.isfinite(tensor).all()


def test_retention_keeps_exactly_keep_last(tmp_path, small_data):
    config = write_config(tmp_path, small_data, steps=10, interval=1, log_sample_ids=False)
    run = tmp_path / "retention"
    train(config, run, 1)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_00000008",
        "step_00000009",
        "step_00000010",
    ]


def test_auto_resume_continues_a_requeued_run(tmp_path, small_data):
    config = write_config(tmp_path, small_data, steps=8, interval=4, log_sample_ids=False)
    run = tmp_path / "requeued"
    train(config, run, 1, "--train.stop_at_step", "4")
    proc = train(config, run, 1, "--checkpoint.auto_resume", "true")
    assert "resumed from" in proc.stderr
    assert sorted(step_losses(run)) == list(range(1, 9))


def assert_same_state(a, b, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_state(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_state(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif not where.endswith(("wall_s", "time", "elapsed")):
        assert a == b, where


# make test runs one case per mechanism (FSDP, DDP with async save); the rest under the slow marker
_SLOW = pytest.mark.slow
LAGGED_CASES = [
    pytest.param(7, "ddp", False, marks=_SLOW),
    pytest.param(5, "ddp", False, marks=_SLOW),
    (7, "fsdp", False),
    pytest.param(7, "zero1", False, marks=_SLOW),
    (6, "ddp", True),
    pytest.param(7, "pp", False, marks=_SLOW),
]


@pytest.mark.parametrize("nan_step,layout,async_save", LAGGED_CASES)
def test_lagged_checks_stop_a_nan_step_with_the_state_before_it(tmp_path, small_data, nan_step, layout, async_save):
    """train.lagged_checks with the fused AdamW (on CPU here): the NaN step's verdict is read one step later (or at
    the next save), its update was skipped through found_inf, and the run stops with the same checkpoint, optimizer
    state, LR schedule and progress as a run that simply stopped before that step."""
    config = write_config(tmp_path, small_data, steps=12, interval=5, log_sample_ids=False)
    # nan_step 7: read at the next step; 5: read at the step-5 checkpoint (a sync point); 6 with async saves: the stop
    # wants step 5, whose background save may still be in flight (it is finished and kept, not rewritten)
    parallel = ("--parallel.pp", "2") if layout == "pp" else ("--parallel.strategy", layout)
    flags = (
        "--train.optimizer_impl",
        "fused",
        "--train.log_interval",
        "10",
        *parallel,
        "--checkpoint.async_save",
        str(async_save).lower(),
    )
    good = nan_step - 1
    ref = tmp_path / "ref"
    train(config, ref, 2, *flags, "--train.stop_at_step", str(good))
    assert json.loads((ref / "summary.json").read_text())["step_checks"] == "lagged"
    run = tmp_path / "nan"
    proc = train(
        config, run, 2, *flags, expect_ok=False, ANYTRAIN_TEST_NAN_AT_STEP=str(nan_step), ANYTRAIN_TEST_NAN_RANK="1"
    )
    assert proc.returncode != 0
    assert proc.stderr.count(f"step {nan_step}: non-finite loss or gradient norm") == 2
    saved = sorted(p.name for p in (run / "checkpoints").iterdir() if (p / "COMMITTED").is_file())
    assert saved == sorted({f"step_{good:08d}"} | ({"step_00000005"} if good >= 5 else set()))  # none after it
    states = [train_state(r / f"checkpoints/step_{good:08d}", tmp_path) for r in (run, ref)]
    assert states[1]["metrics"]["window_steps"] == good  # no record at a stop off the log interval: the window is saved
    assert_same_state(*states)  # the NaN step taken out of the window again (lagged: it had been counted)


@pytest.mark.slow
def test_resume_keeps_the_optimizer_kernel_of_this_run(tmp_path, small_data):
    """The param groups' fused/foreach choice comes from this run's config and machine, not from the checkpoint: a
    fused (lagged-checks) checkpoint resumes with foreach (checks every step), and a 2-process DDP checkpoint of the
    fused kernel resumes under tensor parallelism (per-tensor updates)."""
    config = write_config(tmp_path, small_data, steps=8, interval=2, log_sample_ids=False)
    run = tmp_path / "impl"
    train(config, run, 2, "--train.optimizer_impl", "fused", "--train.stop_at_step", "2")
    assert json.loads((run / "summary.json").read_text())["step_checks"] == "lagged"
    train(config, run, 2, "--resume", "--train.optimizer_impl", "foreach", "--train.stop_at_step", "4")
    assert json.loads((run / "summary.json").read_text())["step_checks"] == "every step"
    train(config, run, 2, "--resume", "--train.optimizer_impl", "fused", "--train.stop_at_step", "6")
    train(config, run, 2, "--resume", "--parallel.tp", "2", "--train.stop_at_step", "8")
    assert max(step_losses(run)) == 8


LOGGED = ("loss", "lr", "grad_norm", "tokens_seen", "skipped_steps")  # the deterministic fields of a train record


def train_records(run_dir: Path) -> dict[int, dict]:
    """The deterministic fields of each step's train record (a step logged twice keeps its last record)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            out[record["step"]] = {key: record[key] for key in LOGGED}
    return out


@pytest.fixture(scope="module")
def windowed(tmp_path_factory, small_data):
    """(tmp, config, reference(nproc) -> run dir): an uninterrupted 12-step run of ``nproc`` processes logging every 3
    steps and saving every 4 (every checkpoint falls inside a log window), trained when a test first asks for it."""
    tmp = tmp_path_factory.mktemp("window")
    config = write_config(tmp, small_data, steps=12, interval=4, log_sample_ids=False, log_interval=3)

    def reference(nproc: int) -> Path:
        run = tmp / f"reference{nproc}"
        if not run.exists():
            train(config, run, nproc)
        return run

    return tmp, config, reference


@pytest.mark.parametrize(
    "nproc,seed", [pytest.param(1, 0, marks=pytest.mark.slow), pytest.param(1, 1, marks=pytest.mark.slow), (2, 2)]
)
def test_every_logged_record_after_a_kill_and_resume_equals_the_uninterrupted_run(windowed, nproc, seed):
    """kill -9 at a random step, resume from the checkpoint inside the log window: the first record after the resume
    averages the same steps (the window's per-rank loss sums are in the checkpoint), and every record equals the
    uninterrupted run's, field by field and bitwise (CPU fp32)."""
    tmp, config, reference = windowed
    kill = random.Random(seed).randint(6, 12)  # after the step-4 checkpoint
    run = tmp / f"killed{nproc}-{seed}"
    # forked ranks (torchrun=False): the dead rank takes the others down as torchrun's agent would; the agent itself
    # is test_kill_9_of_one_rank_then_resume_is_exact's
    proc = train(
        config,
        run,
        nproc,
        expect_ok=False,
        torchrun=False,
        ANYTRAIN_TEST_KILL_AT_STEP=str(kill),
        ANYTRAIN_TEST_KILL_RANK=str(nproc - 1),
    )
    assert proc.returncode != 0
    proc = train(config, run, nproc, "--resume")
    saved = 4 * ((kill - 1) // 4)
    assert f"step_{saved:08d} (step {saved})" in proc.stderr and saved % 3 != 0  # inside a window
    assert train_records(run) == train_records(reference(nproc))
