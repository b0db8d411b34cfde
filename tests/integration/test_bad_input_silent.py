"""Bad input that gave a wrong number without a word, a traceback or a signal: each is now one ``error:`` line naming
the file or field, exit 2, and nothing overwritten. Eval on data of another tokenizer, token ids outside the
vocabulary in the middle of a shard, a shard cut while training, damaged HF folders for model.init_from / arch hf,
``compare --out`` that is not a new PNG, and models too large for the device."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import cli_in_process, run_cli

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune " * 40
OTHER = "Call me Ishmael. Some years ago, never mind how long precisely, having little money in my purse " * 40
BAD_ID = 0xFFFF  # outside any vocabulary a uint16 dataset of 300 ids may hold
TRAIN = ["--model.flavour", "debug", "--data.seq_len", "32", "--train.global_batch", "4", "--train.eval_batches", "1"]


def one_error(proc, *parts: str) -> str:
    """Exit 2 and a last stderr line ``error: ...`` holding every one of ``parts``, with no traceback above it."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("error: "), proc.stderr[-3000:]
    for part in parts:
        assert part in last, last
    return last


def prepare(tmp: Path, name: str, text: str, docs: int) -> Path:
    raw = tmp / f"raw_{name}"
    raw.mkdir()
    for i in range(docs):
        (raw / f"doc{i}.txt").write_text(f"Chapter {i}. " + text)
    proc = run_cli("prepare", str(raw), "--out", str(tmp / name), "--vocab-size", "300", "--val-fraction", "0.3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return tmp / name


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict[str, Path]:
    """A dataset whose train and val shards are longer than the ends read at open (so their middles are only read by
    the loader), another of the same vocabulary size from another tokenizer, and a two-step run on the first."""
    tmp = tmp_path_factory.mktemp("silent")
    data, other = prepare(tmp, "data", TEXT * 3, 40), prepare(tmp, "other", OTHER, 6)
    index = json.loads((data / "index.json").read_text())
    assert min(s["tokens"] for split in index["splits"].values() for s in split) > 3 * 4096
    proc = run_cli(
        "train",
        "configs/tiny.yaml",
        *TRAIN,
        "--data.path",
        str(data),
        "--train.steps",
        "2",
        "--run-dir",
        str(tmp / "run"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {"tmp": tmp, "data": data, "other": other, "run": tmp / "run"}


def copy_dataset(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


def plant_bad_ids(shard: Path) -> None:
    """Overwrite every token of ``shard`` but 4,096 at each end with BAD_ID (the index's size and max_id unchanged)."""
    tokens = np.fromfile(shard, dtype=np.uint16)
    tokens[4096:-4096] = BAD_ID
    tokens.tofile(shard)


# ---------------------------------------------------------------------------------------------------------------------
# eval --data of another tokenizer


def test_eval_on_data_of_another_tokenizer_is_refused(base):
    proc = run_cli("eval", str(base["run"]), "--data", str(base["other"]), "--max-new-tokens", "2", timeout=120)
    one_error(
        proc,
        f"--data: {base['other']} was prepared with another tokenizer than the run's data",
        f"--tokenizer {base['data'] / 'tokenizer.json'}",
    )
    proc = run_cli("eval", str(base["run"]), "--data", str(base["data"]), "--max-new-tokens", "2", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------------------------
# token ids outside the vocabulary, in the middle of a shard


def test_out_of_vocabulary_ids_mid_shard_stop_training_with_one_line(base, tmp_path):
    data = copy_dataset(base["data"], tmp_path / "data")
    plant_bad_ids(data / "train_00000.bin")
    proc = run_cli(
        "train",
        "configs/tiny.yaml",
        *TRAIN,
        "--data.path",
        str(data),
        "--train.steps",
        "4",
        "--run-dir",
        str(tmp_path / "run"),
        timeout=120,
    )
    one_error(proc, f"{data / 'train_00000.bin'}: token id {BAD_ID} at token ", "outside the vocabulary of 300")


def test_out_of_vocabulary_ids_mid_shard_stop_eval_with_one_line(base, tmp_path):
    data = copy_dataset(base["data"], tmp_path / "data")
    plant_bad_ids(data / "val_00000.bin")
    proc = run_cli(
        "eval", str(base["run"]), "--data", str(data), "--batches", "40", "--max-new-tokens", "2", timeout=120
    )
    one_error(proc, f"{data / 'val_00000.bin'}: token id {BAD_ID} at token ", "outside the vocabulary of 300")


# ---------------------------------------------------------------------------------------------------------------------
# a shard cut while training (a memory map's SIGBUS before)


def test_shard_truncated_while_training_is_one_line(base, tmp_path):
    data = copy_dataset(base["data"], tmp_path / "data")
    run_dir, done = tmp_path / "run", {}
    args = [
        "train",
        "configs/tiny.yaml",
        *TRAIN,
        "--data.path",
        str(data),
        "--train.steps",
        "1000000",
        "--train.log_interval",
        "1",
        "--train.eval_interval",
        "0",
        "--run-dir",
        str(run_dir),
    ]
    runner = threading.Thread(target=lambda: done.update(proc=run_cli(*args, timeout=240)))
    runner.start()
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 180
    while not (metrics.is_file() and '"kind": "train"' in metrics.read_text()):  # a step has run
        assert runner.is_alive() and time.monotonic() < deadline, done
        time.sleep(0.1)
    with open(data / "train_00000.bin", "r+b") as fh:
        fh.truncate(1024)
    runner.join()
    one_error(done["proc"], f"{data / 'train_00000.bin'}: 1024 bytes, index.json says", "re-run anytrain prepare")


# ---------------------------------------------------------------------------------------------------------------------
# damaged Hugging Face folders


@pytest.fixture(scope="module")
def hf_folder(base) -> Path:
    out = base["tmp"] / "hf"
    proc = run_cli("export", str(base["run"]), "--out", str(out), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def _truncate_weights(folder: Path) -> Path:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return weights


def _config_as_list(folder: Path) -> Path:
    (folder / "config.json").write_text("[1, 2]")
    return folder / "config.json"


@pytest.mark.parametrize(
    "damage, message",
    [(_truncate_weights, "is not a readable safetensors file"), (_config_as_list, "holds a JSON list")],
)
def test_init_from_a_damaged_hf_folder_is_one_line(base, hf_folder, tmp_path, damage, message):
    folder = copy_dataset(hf_folder, tmp_path / "hf")
    file = damage(folder)
    proc = run_cli(
        "train",
        "configs/tiny.yaml",
        *TRAIN,
        "--data.path",
        str(base["data"]),
        "--train.steps",
        "1",
        "--model.init_from",
        str(folder),
        "--run-dir",
        str(tmp_path / "run"),
        timeout=120,
    )
    one_error(proc, f"model.init_from: {file}", message)


def test_arch_hf_with_truncated_weights_is_one_line(base, hf_folder, tmp_path):
    pytest.importorskip("transformers")
    folder = copy_dataset(hf_folder, tmp_path / "hf")
    file = _truncate_weights(folder)
    proc = run_cli(
        "train",
        "configs/tiny.yaml",
        "--model.arch",
        "hf",
        "--model.hf_path",
        str(folder),
        "--data.path",
        str(base["data"]),
        "--data.seq_len",
        "32",
        "--train.steps",
        "1",
        "--train.global_batch",
        "4",
        "--run-dir",
        str(tmp_path / "run"),
        timeout=120,
    )
    one_error(proc, f"model.hf_path: {file} is not a readable safetensors file")


# ---------------------------------------------------------------------------------------------------------------------
# compare --out


def _metrics_run(path: Path) -> Path:
    path.mkdir()
    records = [
        {"kind": kind, "step": s, key: 6.0 - 0.1 * s, "tokens_seen": 128 * s}
        for s in range(1, 6)
        for kind, key in (("train", "loss"), ("eval", "val_loss"))
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_compare_out_must_be_a_new_png(tmp_path, capsys):
    a, b = _metrics_run(tmp_path / "a"), _metrics_run(tmp_path / "b")
    code, _, err = cli_in_process(capsys, "compare", str(a), str(b), "--out", str(tmp_path / "x.jsonl"))
    assert (
        code == 2
        and err.strip()
        == f"error: --out: {tmp_path / 'x.jsonl'} must end in .png (the curves are written as a PNG image)"
    ), err
    assert not (tmp_path / "x.jsonl").exists()
    png = tmp_path / "curves.png"
    png.write_bytes(b"an earlier plot")
    code, _, err = cli_in_process(capsys, "compare", str(a), str(b), "--out", str(png))
    assert code == 2 and err.strip() == f"error: --out: {png} exists; pass --overwrite to replace it", err
    assert png.read_bytes() == b"an earlier plot"
    pytest.importorskip("matplotlib")
    code, _, err = cli_in_process(capsys, "compare", str(a), str(b), "--out", str(png), "--overwrite")
    assert code == 0, err
    assert png.read_bytes().startswith(b"\x89PNG") and sorted(p.name for p in tmp_path.iterdir()) == [
        "a",
        "b",
        "curves.png",
    ]


# ---------------------------------------------------------------------------------------------------------------------
# models that cannot fit


CAPACITY_GIB = 16  # the host's RAM the refusals below are measured against, whatever this host has


@pytest.mark.parametrize(
    "args, what",
    [
        (["--model.args.dim", "100000"], "fp32 weights alone take"),
        (["--model.args.vocab_size", "100000000"], "fp32 weights alone take 47.7 GiB"),
        # ~1.85e9 parameters: 6.9 GiB of fp32 weights fit, weights + gradients + AdamW moments do not
        (["--model.args.n_layers", "30000"], "the cost model puts a training step's peak at"),
    ],
)
def test_a_model_too_large_for_the_host_is_refused_before_it_is_built(base, tmp_path, capsys, monkeypatch, args, what):
    from anytrain import hardware

    monkeypatch.setattr(hardware, "memory_capacity", lambda device: CAPACITY_GIB * 2**30)
    run = ["train", "configs/tiny.yaml", *TRAIN, "--data.path", str(base["data"]), "--train.steps", "1"]
    start = time.monotonic()
    code, _, err = cli_in_process(capsys, *run, "--device", "cpu", *args, "--run-dir", str(tmp_path / "run"))
    assert code == 2 and "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    host = f"more than the host's RAM of {CAPACITY_GIB}.0 GiB"
    for part in ("error: model.args: transformer/debug has", what, host):
        assert part in last, last
    assert time.monotonic() - start < 60 and not (tmp_path / "run").exists()


def test_a_model_beyond_any_host_is_refused_through_the_cli(base, tmp_path):
    """Without a patched capacity: 1e12 embedding rows of 64 fp32 weights (over 400 TiB) fit no machine."""
    run = ["train", "configs/tiny.yaml", *TRAIN, "--data.path", str(base["data"]), "--train.steps", "1"]
    vocab = ["--model.args.vocab_size", "1000000000000"]
    proc = run_cli(*run, "--device", "cpu", *vocab, "--run-dir", str(tmp_path / "run"), timeout=120)
    one_error(proc, "model.args: transformer/debug has", "fp32 weights alone take", "more than the host's RAM of")
    assert not (tmp_path / "run").exists()
