"""The CLI end to end on the tiny recipe, and its answers to bad input (one error line, exit != 0, nothing lost)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import cli_in_process, run_cli


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, shakespeare_data):
    run_dir = tmp_path_factory.mktemp("cli") / "tiny"
    proc = run_cli(
        "train",
        "configs/tiny.yaml",
        "--train.steps",
        "4",
        "--train.warmup_steps",
        "2",
        "--data.path",
        str(shakespeare_data),
        "--run-dir",
        str(run_dir),
        "--train.eval_interval",
        "0",
        "--train.log_interval",
        "1",
        "--checkpoint.interval",
        "2",
        "--train.global_batch",
        "8",
        "--train.eval_batches",
        "1",
        "--data.seq_len",
        "64",  # the recipe's 256 trains its 7M parameters ~2.5x longer, for nothing these tests read
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc


def test_train_tiny_end_to_end(tiny_run):
    run_dir, proc = tiny_run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for key in ("loss", "lr", "grad_norm", "tokens_seen", "tokens_per_s", "mfu", "peak_mem_gib"):
        assert key in train[-1]
    assert train[-1]["mfu"] is None  # CPU: no invented peak
    assert train[-1]["tokens_seen"] == 4 * 8 * 64
    assert train[-1]["loss"] < train[0]["loss"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 4] and evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert (run_dir / "config.yaml").is_file() and any((run_dir / "tensorboard").iterdir())
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step_00000002", "step_00000004"]
    assert "run dir:" in proc.stdout and "MFU n/a" in proc.stdout


def test_eval_reads_the_checkpoint(tiny_run):
    run_dir, _ = tiny_run
    proc = run_cli("eval", str(run_dir), "--json", "--max-new-tokens", "8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert result["step"] == 4
    assert abs(result["val_loss"] - summary["final_val_loss"]) < 1e-3
    assert result["sample"].startswith("ROMEO.")


def test_existing_run_dir_is_refused_and_untouched(tiny_run, shakespeare_data):
    run_dir, _ = tiny_run
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    proc = run_cli(
        "train",
        "configs/tiny.yaml",
        "--train.steps",
        "2",
        "--run-dir",
        str(run_dir),
        "--data.path",
        str(shakespeare_data),
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {run_dir}: run dir already holds a run")
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data.path", "/nonexistent/data"], "error: data.path: /nonexistent/data has no index.json"),
        (["--train.stepz", "3"], "error: train.stepz: unknown field"),
        (["--train.steps", "many"], "error: train.steps: expected an integer, got 'many'"),
        (["--train.global_batch", "15", "--train.micro_batch", "4"], "error: train.global_batch: 15 is not divisible"),
        (["--model.args.vocab_size", "100"], "error: model.args.vocab_size: 100 is smaller than the tokenizer"),
    ],
)
def test_bad_input_one_line_error(tmp_path, shakespeare_data, args, message):
    run_dir = tmp_path / "run"
    base = ["train", "configs/tiny.yaml", "--data.path", str(shakespeare_data), "--run-dir", str(run_dir)]
    # later occurrences win, so the case's own --data.path overrides the fixture's
    proc = run_cli(*base, *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), proc.stderr
    assert not run_dir.exists()  # nothing created


def test_missing_config_file(tmp_path):
    proc = run_cli("train", str(tmp_path / "none.yaml"))
    assert proc.returncode == 2 and "config file not found" in proc.stderr


def test_prepare_refuses_to_clobber(tmp_path, small_data):
    target = Path(tmp_path / "keep")
    target.mkdir()
    (target / "precious.txt").write_text("do not delete")
    proc = run_cli("prepare", "shakespeare", "--out", str(target), "--overwrite")
    assert proc.returncode == 2 and "refusing to delete" in proc.stderr
    assert (target / "precious.txt").read_text() == "do not delete"


def test_export_to_safetensors(tiny_run, tmp_path):
    from safetensors.torch import load_file

    run_dir, _ = tiny_run
    out = tmp_path / "model.safetensors"
    proc = run_cli("export", str(run_dir), "--format", "safetensors", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    tensors = load_file(str(out))
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["arch"] == "transformer" and meta["args"]["n_layers"] == 4
    assert "layers.0.attention.wq.weight" in tensors and tensors["tok_embeddings.weight"].shape == (8192, 256)
    # identical to the weights the eval path loads from the DCP checkpoint
    import torch

    from anytrain.checkpoint.run_model import load_run_model

    _, model, _ = load_run_model(run_dir, torch.device("cpu"))
    for key, value in model.state_dict().items():
        assert torch.equal(tensors[key], value), key
    again = run_cli("export", str(run_dir), "--format", "safetensors", "--out", str(out))
    assert again.returncode == 2 and "exists; pass --overwrite" in again.stderr
    # the deprecated alias says so in one stderr line, then does the same
    alias = run_cli("export-checkpoint", str(run_dir), "--out", str(out), "--overwrite")
    assert alias.returncode == 0, alias.stderr[-2000:]
    assert alias.stderr.strip().splitlines() == [
        "warning: `anytrain export-checkpoint` is deprecated; use `anytrain export RUN --format safetensors --out FILE`"
    ]
    assert load_file(str(out)).keys() == tensors.keys()
    only_hf = run_cli("export", str(run_dir), "--format", "safetensors", "--out", str(out), "--tokenizer", "t.json")
    assert only_hf.returncode == 2 and "--tokenizer: only with --format hf" in only_hf.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (("plan", "configs/1.1b.yaml", "--device", "h100"), "No such option: --device"),
        (("plan",), "Missing option '--model'"),
    ],
)
def test_usage_errors_exit_2_without_a_traceback(capsys, args, message):
    code, _, err = cli_in_process(capsys, *args)
    assert code == 2 and message in err and "Traceback" not in err and "│" not in err
