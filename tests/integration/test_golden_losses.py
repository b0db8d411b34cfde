"""Golden losses: the first steps of the debug Transformer and Mamba, trained on CPU in fp32 on a fixed tiny corpus,
must reproduce the losses stored in tests/assets/losses/ within the tolerance stored beside them.

A change of the model maths, the init, the data order, the tokenizer training, the optimizer or configs/tiny*.yaml shows
up here. After an intended change, regenerate (and say why in the commit):
``PYTHONPATH=src python -m tests.integration.test_golden_losses``. The same runs on a GPU (fp32, TF32 off) are
tests/gpu/test_golden_losses_gpu.py, against the CPU file and a GPU file written on a GPU machine with ``--gpu``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "losses"
STEPS = 8
TOLERANCE = 5e-4
"""Absolute, per step. One thread, fp32: bitwise equal run to run here (and with 2 threads); the margin is for other
CPUs' vector kernels and torch versions over 8 steps, far below the ~0.05 a step of training moves the loss."""
RECIPES = {"transformer": "configs/tiny.yaml", "mamba": "configs/tiny-mamba.yaml"}
OVERRIDES = [
    "--model.flavour",
    "debug",
    "--model.args.n_layers",
    "2",
    "--data.seq_len",
    "32",
    "--train.global_batch",
    "4",
    "--train.steps",
    str(STEPS),
    "--train.log_interval",
    "1",
    "--train.eval_interval",
    "0",
    "--train.eval_batches",
    "1",
    "--train.dtype",
    "fp32",
    "--train.warmup_steps",
    "2",
    "--train.lr",
    "3e-3",
    "--checkpoint.save_final",
    "false",
    "--model.init_device",
    "cpu",
]
"""``model.init_device cpu``: the GPU runs start from the CPU's initial weights (a GPU's generator draws others)."""


def make_corpus(root: Path) -> Path:
    """The fixed corpus: the first 48,000 characters of the first embedded play as 24 documents, a 320-token
    vocabulary trained on them."""
    from anytrain.data.prepare import embedded_corpus_dir, prepare

    text = sorted(embedded_corpus_dir().glob("*_gut.txt"))[0].read_text(encoding="utf-8", errors="replace")[:48_000]
    raw = root / "raw"
    raw.mkdir(parents=True)
    for i in range(24):
        (raw / f"doc{i:02d}.txt").write_text(text[i * 2000 : (i + 1) * 2000])
    prepare([str(raw)], root / "data", vocab_size=320, val_fraction=0.1)
    return root / "data"


def train_losses(arch: str, data: Path, run_dir: Path, device: str = "cpu") -> list[float]:
    from anytrain.config import load_config
    from anytrain.train.trainer import run_training

    torch.set_num_threads(1)  # the same reduction order whatever the machine's core count
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32 on GPUs too
    cfg = load_config(RECIPES[arch], OVERRIDES + ["--data.path", str(data), "--device", device])
    run_training(cfg, run_dir=str(run_dir))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("golden"))


@pytest.mark.parametrize("arch", list(RECIPES))
def test_first_losses_match_the_golden_file(arch, corpus, tmp_path):
    threads = torch.get_num_threads()
    try:
        losses = train_losses(arch, corpus, tmp_path / "run")
    finally:
        torch.set_num_threads(threads)
    golden = json.loads(golden_path(arch).read_text())
    assert golden["overrides"] == OVERRIDES and len(losses) == STEPS
    assert losses == pytest.approx(golden["losses"], abs=golden["tolerance"], rel=0)


def golden_path(arch: str, device: str = "cpu") -> Path:
    return ASSETS / f"{arch}-debug-{device}-fp32.json"


def regenerate(device: str = "cpu") -> None:
    from anytrain import hardware

    ASSETS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        data = make_corpus(Path(tmp))
        for arch in RECIPES:
            losses = train_losses(arch, data, Path(tmp) / arch, device)
            flag = " --gpu" if device == "gpu" else ""
            record = {
                "arch": arch,
                "recipe": RECIPES[arch],
                "overrides": OVERRIDES,
                "tolerance": TOLERANCE,
                "torch": torch.__version__,
                "device": hardware.device_name(hardware.resolve_device(device)),
                "losses": losses,
                "regenerate": f"PYTHONPATH=src python -m tests.integration.test_golden_losses{flag}",
            }
            golden_path(arch, device).write_text(json.dumps(record, indent=1) + "\n")
            print(f"{arch}: {losses}", file=sys.stderr)


if __name__ == "__main__":
    regenerate("gpu" if "--gpu" in sys.argv[1:] else "cpu")
