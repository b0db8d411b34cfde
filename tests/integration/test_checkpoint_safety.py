"""A checkpoint never runs code when loaded (checkpoint/safe_load.py).

A real run's checkpoint gets a planted pickle — in ``.metadata`` (DCP pickles it) or in a non-tensor value of a
``.distcp`` file (DCP's planner unpickles those with torch.load) — whose unpickling would call ``os.system("touch
MARKER")``, and its COMMITTED marker is rewritten with the new sizes and sha256s, as an attacker would. ``eval``,
``train --resume`` and ``export`` (both formats) must refuse it with one line naming the file (exit 2), create nothing,
not fall back to an older checkpoint, and never create MARKER. Every case runs the real CLI on the debug model (CPU)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from anytrain.checkpoint.dcp import COMMIT_MARKER, Checkpointer, CheckpointUnusable, file_manifest, verify
from tests.checkpoint_tampering import edit_metadata, plant_value, point_outside
from tests.conftest import run_cli

NEWEST = "checkpoints/step_00000004"


class RunsCode:
    """Unpickles as ``os.system("touch MARKER")``."""

    def __init__(self, marker: Path) -> None:
        self.command = f"touch {shlex.quote(str(marker))}"

    def __reduce__(self):
        return os.system, (self.command,)


def write_config(tmp: Path, data: Path, steps: int = 4) -> Path:
    cfg = tmp / "safety.yaml"
    cfg.write_text(f"""
model: {{arch: transformer, flavour: debug}}
data: {{path: {data}, seq_len: 32}}
train: {{steps: {steps}, global_batch: 8, micro_batch: 4, lr: 3.0e-3, warmup_steps: 2, dtype: fp32,
        log_interval: 1, eval_interval: 0, eval_batches: 1}}
checkpoint: {{interval: 2, keep_last: 5}}
device: cpu
""")
    return cfg


@pytest.fixture(scope="module")
def done_run(tmp_path_factory, small_data):
    """A finished 4-step run with committed checkpoints at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("ckpt_safety")
    config = write_config(tmp, small_data)
    proc = run_cli("train", str(config), "--run-dir", str(tmp / "run"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, config


def copy_run(done_run, dest: Path) -> Path:
    subprocess.run(["cp", "-a", str(done_run[0] / "run"), str(dest)], check=True)
    return dest


def recommit(checkpoint: Path) -> None:
    """COMMITTED with the sizes and sha256s of the files as they are now."""
    marker = json.loads((checkpoint / COMMIT_MARKER).read_text())
    marker["files"] = file_manifest(checkpoint, checksums=True)
    (checkpoint / COMMIT_MARKER).write_text(json.dumps(marker))


def plant_in_metadata(checkpoint: Path, marker: Path) -> Path:
    """The real metadata with one more attribute, the payload (without the fix it loads as usual, after the call)."""
    file = edit_metadata(checkpoint, lambda metadata: setattr(metadata, "note", RunsCode(marker)))
    recommit(checkpoint)
    return file


def plant_in_value(checkpoint: Path, marker: Path, key: str = "train.progress.step") -> Path:
    """The payload, torch.save'd, appended to the .distcp file that holds ``key``, and ``key`` pointed at it."""
    shard = plant_value(checkpoint, key, RunsCode(marker))
    recommit(checkpoint)
    return shard


def snapshot(path: Path) -> dict:
    """Size and mtime of every file but what any refused resume writes: the lock (taken, the holder recorded),
    status.json (``failed`` and the error line) and the tensorboard writer's opened event file."""
    files = (p for p in path.rglob("*") if p.is_file() and p.name not in (".anytrain-run.lock", "status.json"))
    files = (p for p in files if p.parent.name != "tensorboard")
    return {p.relative_to(path): (p.stat().st_size, p.stat().st_mtime_ns) for p in files}


def refused(proc: subprocess.CompletedProcess, file: Path, what: str) -> None:
    """Exit 2 and one stderr line: the refusal naming ``file`` and the planted global."""
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"error: {file}: refusing to load: it names {what}"), lines[0]
    assert "delete it, or restore it from a copy you trust" in lines[0]


def test_a_planted_metadata_pickle_is_refused_by_every_loader(done_run, tmp_path):
    run = copy_run(done_run, tmp_path / "run")
    marker = tmp_path / "code-ran"
    file = plant_in_metadata(run / NEWEST, marker)
    before = snapshot(run)
    outputs = {"hf": tmp_path / "hf", "st": tmp_path / "m.safetensors"}
    commands = {
        "eval": ("eval", str(run), "--json", "--max-new-tokens", "2"),
        "resume": ("train", str(done_run[1]), "--run-dir", str(run), "--resume"),
        "export": ("export", str(run), "--out", str(outputs["hf"])),
        "export step dir": ("export", str(run / NEWEST), "--out", str(outputs["hf"])),
        "export safetensors": ("export", str(run), "--format", "safetensors", "--out", str(outputs["st"])),
        "export safetensors --checkpoint": (
            "export",
            str(run),
            "--format",
            "safetensors",
            "--out",
            str(outputs["st"]),
            "--checkpoint",
            "step_00000004",
        ),
    }
    for name, args in commands.items():
        refused(run_cli(*args, timeout=120), file, "posix.system")
        assert not marker.exists(), f"{name}: the planted pickle ran"
        assert snapshot(run) == before, f"{name}: the run dir changed"  # nothing renamed, nothing written
        for out in outputs.values():
            assert not out.exists() and not out.with_suffix(".json").exists(), f"{name}: wrote {out}"
    assert not list(tmp_path.glob(".*"))  # no temporary export folders / files left either


def test_a_planted_value_pickle_is_refused_on_resume(done_run, tmp_path):
    """Non-tensor values (progress, schedule) are read by --resume only; eval and export read the model tensors."""
    run = copy_run(done_run, tmp_path / "run")
    marker = tmp_path / "code-ran"
    shard = plant_in_value(run / NEWEST, marker)
    before = snapshot(run)
    proc = run_cli("train", str(done_run[1]), "--run-dir", str(run), "--resume", timeout=120)
    refused(proc, shard, "posix.system (in train.progress.step)")
    assert not marker.exists()
    assert snapshot(run) == before
    proc = run_cli("eval", str(run), "--json", "--max-new-tokens", "2", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["step"] == 4 and not marker.exists()


def test_a_storage_path_outside_the_checkpoint_is_refused_by_every_loader(done_run, tmp_path):
    """.metadata pointing its entries at '../x' (a real .distcp file of the run, copied outside): DCP would read it from
    there; every loader refuses it with one line naming .metadata, without falling back to step 2."""
    run = copy_run(done_run, tmp_path / "run")
    checkpoint = run / NEWEST
    shard = next(checkpoint.glob("*.distcp"))
    (checkpoint.parent / "x").write_bytes(shard.read_bytes())
    file = point_outside(checkpoint, "../x")
    recommit(checkpoint)
    before = snapshot(run)
    commands = [
        ("eval", str(run), "--json", "--max-new-tokens", "2"),
        ("train", str(done_run[1]), "--run-dir", str(run), "--resume"),
        ("export", str(run), "--out", str(tmp_path / "hf")),
    ]
    for args in commands:
        proc = run_cli(*args, timeout=120)
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr[-3000:]
        assert lines[0].startswith(f"error: {file}: refusing to load: the storage entry of "), lines[0]
        assert "names the file '../x', outside the checkpoint folder" in lines[0], lines[0]
        assert snapshot(run) == before and not (tmp_path / "hf").exists(), args


def test_a_committed_marker_naming_a_file_outside_is_not_read(done_run, tmp_path):
    """COMMITTED listing '../../../outside' (present, with its true size and sha256): verify reads no file outside the
    checkpoint folder; the checkpoint is unusable, and with both markers so the command is one line, exit 2."""
    run = copy_run(done_run, tmp_path / "run")
    outside = tmp_path / "outside"
    outside.write_bytes(b"not a checkpoint file")
    for step in ("step_00000002", "step_00000004"):
        checkpoint = run / "checkpoints" / step
        marker = json.loads((checkpoint / COMMIT_MARKER).read_text())
        marker["files"]["../../../outside"] = file_manifest(tmp_path, checksums=True)["outside"]
        (checkpoint / COMMIT_MARKER).write_text(json.dumps(marker))
    why = "its COMMITTED marker lists '../../../outside', not a file of the checkpoint folder"
    assert verify(run / NEWEST) == why
    with pytest.raises(CheckpointUnusable, match=why):
        Checkpointer(run / "checkpoints", keep_last=5, is_main=True).load(run / NEWEST, {})
    proc = run_cli("eval", str(run), "--json", "--max-new-tokens", "2", timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {run / 'checkpoints'}: no committed checkpoint can be loaded") and why in last


def test_a_legitimate_checkpoint_still_resumes_and_exports(done_run, tmp_path):
    run = copy_run(done_run, tmp_path / "run")
    proc = run_cli("train", str(done_run[1]), "--run-dir", str(run), "--resume", "--train.steps", "5", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {run / NEWEST} (step 4)" in proc.stderr
    proc = run_cli("export", str(run), "--out", str(tmp_path / "hf"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_an_fsdp_sharded_checkpoint_of_two_ranks_loads(tmp_path, small_data):
    """The metadata of an FSDP-sharded checkpoint (two gloo ranks, DTensor chunks) passes the restricted unpickler:
    eval and export-checkpoint read it (tests/distributed resume such checkpoints at other world sizes)."""
    config = write_config(tmp_path, small_data, steps=2)
    run = tmp_path / "fsdp"
    proc = run_cli(
        "train",
        str(config),
        "--run-dir",
        str(run),
        "--parallel.strategy",
        "fsdp",
        "--train.micro_batch",
        "2",
        nproc=2,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli("eval", str(run), "--json", "--max-new-tokens", "2", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["step"] == 2
    proc = run_cli("export", str(run), "--format", "safetensors", "--out", str(tmp_path / "m.safetensors"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
