"""Bad input to prepare, train, eval and export through the CLI: exit code 2, exactly one stderr line
naming the field or file, and nothing partial left behind or pre-existing removed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import run_cli

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune " * 40


def one_error(proc, *parts: str) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    raw = tmp_path_factory.mktemp("raw")
    for i in range(6):
        (raw / f"doc{i}.txt").write_text(f"Chapter {i}. " + TEXT)
    return raw


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus):
    """A two-step debug run whose data.path was given relative to the folder it was launched from."""
    base = tmp_path_factory.mktemp("bad_input")
    proc = run_cli("prepare", str(corpus), "--out", str(base / "data"), "--vocab-size", "300", "--val-fraction", "0.3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run_cli(
        "train",
        str(Path("configs/tiny.yaml").resolve()),
        "--model.flavour",
        "debug",
        "--data.path",
        "data",
        "--data.seq_len",
        "32",
        "--train.steps",
        "2",
        "--train.global_batch",
        "4",
        "--train.eval_batches",
        "1",
        "--run-dir",
        "run",
        cwd=base,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return base, base / "run"


# ---------------------------------------------------------------------------------------------------------------------
# prepare


def test_prepare_overwrite_spares_a_folder_that_is_not_a_dataset(tmp_path, corpus):
    web = tmp_path / "webapp"
    (web / "assets").mkdir(parents=True)
    (web / "index.html").write_text("<html>")
    (web / "assets" / "app.js").write_text("js")
    (web / "index.json").write_text("{}")
    before = snapshot(web)
    proc = run_cli("prepare", str(corpus), "--out", str(web), "--overwrite", "--vocab-size", "300")
    one_error(proc, str(web), "not a dataset written by anytrain prepare", "refusing to delete")
    assert snapshot(web) == before and sorted(p.name for p in tmp_path.iterdir()) == ["webapp"]


@pytest.mark.parametrize(
    "args, field",
    [
        (["--shard-tokens", "0"], "--shard-tokens: must be >= 1, got 0"),
        (["--shard-tokens", "-1"], "--shard-tokens: must be >= 1, got -1"),
        (["--vocab-size", "10"], "--vocab-size: must be at least 258"),
        (["--val-fraction", "1"], "--val-fraction: must be in (0, 1)"),
        (["--encoding-errors", "ignore"], "--encoding-errors: expected one of strict, replace"),
    ],
)
def test_prepare_bad_options(tmp_path, corpus, args, field):
    proc = run_cli("prepare", str(corpus), "--out", str(tmp_path / "out"), *args, timeout=60)
    one_error(proc, field)
    assert list(tmp_path.iterdir()) == []


def test_prepare_non_utf8_and_integer_parquet_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "latin1.txt").write_bytes(b"na\xefve " + TEXT.encode())
    proc = run_cli("prepare", str(tmp_path / "latin1.txt"), "--out", str(tmp_path / "out"))
    one_error(proc, "latin1.txt: not UTF-8 at byte 2", "--encoding-errors replace")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    proc = run_cli("prepare", str(tmp_path / "ints.parquet"), "--out", str(tmp_path / "out"))
    one_error(proc, "ints.parquet: column 'text' holds int64, not strings")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------------------
# train: refused at load, before the run dir exists


@pytest.mark.parametrize(
    "args, field",
    [
        (["--train.lr", "nan"], "train.lr: must be a finite number, got nan"),
        (["--train.lr", ".inf"], "train.lr: must be a finite number, got inf"),
        (["--train.beta1", "1.5"], "train.beta1: must be in [0.0, 1.0), got 1.5"),
        (["--train.eps", "-1"], "train.eps: must be > 0, got -1"),
        (["--data.seq_len", "1000000000"], "data.seq_len: 1000000000 exceeds model.args.max_seq_len 256"),
        (["--model.args.max_seq_len", "1000000000"], "model.args.max_seq_len: must be in [1, 1048576]"),
    ],
)
def test_train_bad_numbers_leave_no_run_dir(tmp_path, run, args, field):
    base, _ = run
    run_dir = tmp_path / "run"
    proc = run_cli(
        "train",
        "configs/tiny.yaml",
        "--model.flavour",
        "debug",
        "--data.path",
        str(base / "data"),
        "--run-dir",
        str(run_dir),
        *args,
        timeout=120,
    )
    one_error(proc, field)
    assert not run_dir.exists()


def copy_dataset(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / "index.json").write_text('{"format": 1, "dtype": "uint16"'), "index.json: not valid JSON"),
        (lambda d: (d / "index.json").write_text('{"format": 1}'), "index.json: dtype must be one of"),
        (
            lambda d: (d / "train_00000.bin").write_bytes(b"\xff\xff" * (d / "train_00000.bin").stat().st_size),
            "index says",
        ),
        (
            lambda d: (d / "train_00000.bin").write_bytes(b"\xff\xff" * ((d / "train_00000.bin").stat().st_size // 2)),
            "token id 65535 is outside the vocabulary",
        ),
    ],
)
def test_train_on_a_damaged_dataset_is_one_line(tmp_path, run, damage, message):
    base, _ = run
    data = copy_dataset(base / "data", tmp_path / "data")
    damage(data)
    run_dir = tmp_path / "run"
    proc = run_cli(
        "train",
        "configs/tiny.yaml",
        "--model.flavour",
        "debug",
        "--data.path",
        str(data),
        "--data.seq_len",
        "32",
        "--run-dir",
        str(run_dir),
        timeout=120,
    )
    one_error(proc, message)
    assert not run_dir.exists()


# ---------------------------------------------------------------------------------------------------------------------
# eval


def test_eval_from_another_folder_finds_the_recorded_data(tmp_path, run):
    base, run_dir = run
    recorded = json.dumps(str(base / "data"))
    assert f"path: {recorded[1:-1]}" in (run_dir / "config.yaml").read_text()  # absolute, not 'data'
    proc = run_cli("eval", str(run_dir), "--json", "--max-new-tokens", "2", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["step"] == 2


def test_eval_with_moved_data_names_the_path_and_data_option_overrides(tmp_path, run):
    base, run_dir = run
    moved = copy_dataset(base / "data", tmp_path / "moved")
    config = run_dir / "config.yaml"
    original = config.read_text()
    try:
        config.write_text(original.replace(str(base / "data"), str(tmp_path / "gone")))
        proc = run_cli("eval", str(run_dir), "--max-new-tokens", "2", timeout=120)
        one_error(proc, f"data.path in {config}: {tmp_path / 'gone'} has no index.json", "pass --data PATH")
        proc = run_cli("eval", str(run_dir), "--json", "--max-new-tokens", "2", "--data", str(moved), timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
    finally:
        config.write_text(original)


@pytest.mark.parametrize(
    "args, field",
    [
        (["--batches", "-1"], "--batches: must be >= 0"),
        (["--max-new-tokens", "-5"], "--max-new-tokens: must be >= 0"),
        (["--data", "/nonexistent/data"], "--data: /nonexistent/data has no index.json"),
    ],
)
def test_eval_bad_options(run, args, field):
    _, run_dir = run
    one_error(run_cli("eval", str(run_dir), *args, timeout=120), field)


# ---------------------------------------------------------------------------------------------------------------------
# export --format safetensors


def test_export_refuses_a_json_out_and_writes_nothing(tmp_path, run):
    _, run_dir = run
    proc = run_cli("export", str(run_dir), "--format", "safetensors", "--out", str(tmp_path / "m.json"), timeout=120)
    one_error(proc, "--out:", "m.json must end in .safetensors")
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_an_existing_sidecar_and_overwrite_replaces_both(tmp_path, run):
    _, run_dir = run
    out = tmp_path / "m.safetensors"
    (tmp_path / "m.json").write_text("mine")
    proc = run_cli("export", str(run_dir), "--format", "safetensors", "--out", str(out), timeout=120)
    one_error(proc, f"{tmp_path / 'm.json'}: exists; pass --overwrite")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"] and (tmp_path / "m.json").read_text() == "mine"
    proc = run_cli("export", str(run_dir), "--format", "safetensors", "--out", str(out), "--overwrite", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "m.json").read_text())["arch"] == "transformer"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json", "m.safetensors"]


def test_export_missing_checkpoint_is_one_line(tmp_path, run):
    _, run_dir = run
    out = str(tmp_path / "m.safetensors")
    proc = run_cli(
        "export",
        str(run_dir),
        "--format",
        "safetensors",
        "--out",
        out,
        "--checkpoint",
        str(tmp_path / "nope"),
        timeout=120,
    )
    one_error(proc, f"--checkpoint: {tmp_path / 'nope'} is not a checkpoint directory")
    assert list(tmp_path.iterdir()) == []


def test_export_to_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, run):
    _, run_dir = run
    mount = tmp_path / "full"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        proc = run_cli(
            "export", str(run_dir), "--format", "safetensors", "--out", str(mount / "m.safetensors"), timeout=120
        )
        one_error(proc, f"disk full while writing {mount / 'm.safetensors'}")
        assert list(mount.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)
