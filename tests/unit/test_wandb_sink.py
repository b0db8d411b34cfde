"""metrics.wandb: a tiny CPU run in offline mode writes its W&B run under the run dir, with the resolved config and
the loss values of metrics.jsonl (read back from wandb's own run file); --resume continues the same W&B run id;
disabled mode writes and imports nothing; without the wandb package the run stops with one line and the install hint.
"""

from __future__ import annotations

import importlib.abc
import json
import struct
import sys
import zlib
from pathlib import Path

import pytest

from tests.conftest import cli_in_process


def _write_config(tmp_path: Path, data: Path, mode: str) -> Path:
    config = tmp_path / "tiny.yaml"
    config.write_text(f"""
model: {{arch: transformer, flavour: debug}}
data: {{path: {data}, seq_len: 32}}
train: {{steps: 4, global_batch: 4, lr: 3.0e-3, warmup_steps: 1, dtype: fp32, log_interval: 1, eval_interval: 2,
        eval_batches: 1}}
metrics: {{wandb: {{mode: {mode}, project: anytrain-test, group: unit, tags: [tiny, cpu]}}}}
device: cpu
""")
    return config


# wandb's run file (run-ID.wandb) is a LevelDB-style log: a 7-byte header (":W&B", 0xBEE1, version 0), then 32 KiB
# blocks of chunks, each (crc32 of type byte + data, length, type: 1 full, 2 first, 3 middle, 4 last) + data; the
# records are wandb.proto Record messages.
_BLOCK = 32768


def _wandb_records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a chunk header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def _read_offline_run(folder: Path) -> tuple[str, dict, dict[int, dict]]:
    """(run id, config, {step: logged values}) of one offline-run-* folder."""
    (run_file,) = folder.glob("run-*.wandb")
    run_id, config, history = "", {}, {}
    for record in _wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            updates = record.run.config.update
        elif kind == "config":
            updates = record.config.update
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(row["_step"], {}).update(row)
            continue
        else:
            continue
        config.update({item.key: json.loads(item.value_json) for item in updates})
    return run_id, config, history


def _train(capsys, *args: str) -> tuple[int, str]:
    """``anytrain train ARGS`` in this process, then the end of wandb's service, as at the end of a CLI process: the
    service completes the run file when it ends (``run.finish`` may return before the file's last flush)."""
    import wandb

    code, _, err = cli_in_process(capsys, "train", *args)
    wandb.teardown()
    return code, err


def _jsonl(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_offline_run_logs_config_and_records_under_the_run_dir_and_resumes_the_same_run(
    tmp_path, small_data, capsys, monkeypatch
):
    pytest.importorskip("wandb")  # the `dev` extra installs it
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))  # wandb's defaults (~/.cache/wandb, ~/.config/wandb) must stay unused
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("WANDB_CACHE_DIR", raising=False)
    run_dir = tmp_path / "run"
    config = _write_config(tmp_path, small_data, "offline")
    code, err = _train(capsys, str(config), "--run-dir", str(run_dir))
    assert code == 0, err[-3000:]
    run_id = (run_dir / "wandb" / "run_id").read_text().strip()
    (folder,) = (run_dir / "wandb").glob(f"offline-run-*-{run_id}")
    logged_id, logged_config, history = _read_offline_run(folder)
    assert logged_id == run_id
    assert logged_config["train"]["steps"] == 4 and logged_config["model"]["flavour"] == "debug"
    assert logged_config["metrics"]["wandb"]["tags"] == ["tiny", "cpu"]
    assert logged_config["anytrain_run"] == {
        "run_dir": str(run_dir.resolve()),
        "resumed": False,
        "start_step": 0,
        "checkpoint": None,
    }
    records = _jsonl(run_dir)
    train = {r["step"]: r for r in records if r["kind"] == "train"}
    evals = {r["step"]: r for r in records if r["kind"] == "eval"}
    assert sorted(train) == [1, 2, 3, 4] and sorted(evals) == [0, 2, 4]
    assert {s: history[s]["train/loss"] for s in train} == {s: r["loss"] for s, r in train.items()}
    assert {s: history[s]["train/lr"] for s in train} == {s: r["lr"] for s, r in train.items()}
    assert {s: history[s]["eval/val_loss"] for s in evals} == {s: r["val_loss"] for s, r in evals.items()}
    assert list(home.iterdir()) == []

    # --resume: the same W&B run id, a second offline folder with the steps after the checkpoint of step 4
    code, err = _train(capsys, str(config), "--run-dir", str(run_dir), "--resume", "--train.steps", "6")
    assert code == 0, err[-3000:]
    assert (run_dir / "wandb" / "run_id").read_text().strip() == run_id
    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(f.name.endswith(f"-{run_id}") for f in folders)
    logged_id, logged_config, history = _read_offline_run(next(f for f in folders if f != folder))
    assert logged_id == run_id and logged_config["train"]["steps"] == 6
    identity = logged_config["anytrain_run"]
    assert identity["resumed"] is True and identity["start_step"] == 4
    assert identity["checkpoint"].endswith("step_00000004")
    resumed_train = {r["step"]: r["loss"] for r in _jsonl(run_dir) if r["kind"] == "train" and r["step"] > 4}
    assert {s: history[s]["train/loss"] for s in resumed_train} == resumed_train and sorted(resumed_train) == [5, 6]


class _BlockWandb(importlib.abc.MetaPathFinder):
    """``import wandb`` fails as it does where the package is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "wandb" or name.startswith("wandb."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


@pytest.fixture
def without_wandb(monkeypatch):
    for name in [m for m in sys.modules if m == "wandb" or m.startswith("wandb.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_BlockWandb(), *sys.meta_path])


def test_without_wandb_an_enabled_mode_is_one_line_with_the_install_hint(tmp_path, small_data, capsys, without_wandb):
    run_dir = tmp_path / "run"
    config = _write_config(tmp_path, small_data, "offline")
    code, _, err = cli_in_process(capsys, "train", str(config), "--run-dir", str(run_dir))
    assert code == 2
    assert err.strip().splitlines() == [
        "error: metrics.wandb.mode: offline needs the wandb package (No module named 'wandb'); pip install "
        "'anytrain[wandb]', or set --metrics.wandb.mode disabled"
    ]
    assert not run_dir.exists()


def test_disabled_mode_needs_no_wandb_and_writes_nothing_of_it(tmp_path, small_data, capsys, without_wandb):
    run_dir = tmp_path / "run"
    config = _write_config(tmp_path, small_data, "disabled")
    code, _, err = cli_in_process(capsys, "train", str(config), "--run-dir", str(run_dir), "--train.steps", "2")
    assert code == 0, err[-3000:]
    assert not (run_dir / "wandb").exists() and "wandb" not in sys.modules
    assert [r["step"] for r in _jsonl(run_dir) if r["kind"] == "train"] == [1, 2]
