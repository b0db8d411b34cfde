"""The debug Mamba LM under real multi-process gloo: world 1 vs 2-process DDP vs 2-process FSDP2 agree to 1e-5."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT, cli_env

STEPS = 5

# Runs the CLI with the Mamba spec registered (a no-op once anytrain.models registers it itself).
LAUNCHER = """
import sys
from anytrain import models
from anytrain.models.mamba import spec
if "mamba" not in models.REGISTRY:
    models.register(spec())
from anytrain.cli import main
sys.argv[0] = "anytrain"
main()
"""


def write_config(tmp_path: Path, data: Path) -> Path:
    cfg = tmp_path / "mamba_dp.yaml"
    cfg.write_text(f"""
model: {{arch: mamba, flavour: debug}}
data: {{path: {data}, seq_len: 32}}
train:
  steps: {STEPS}
  global_batch: 8
  micro_batch: 2
  lr: 3.0e-3
  warmup_steps: 2
  dtype: fp32
  log_interval: 1
  eval_interval: 0
  eval_batches: 1
device: cpu
""")
    return cfg


def train(launcher: Path, config: Path, run_dir: Path, nproc: int, *extra: str) -> list[dict]:
    if nproc == 1:
        cmd = [sys.executable, str(launcher)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(launcher)]  # fmt: skip
    proc = subprocess.run([*cmd, "train", str(config), "--run-dir", str(run_dir), *extra], cwd=ROOT,
                          env=cli_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_data) -> dict[str, tuple[Path, list[dict]]]:
    tmp = tmp_path_factory.mktemp("mamba_dp")
    launcher = tmp / "launch_anytrain.py"
    launcher.write_text(LAUNCHER)
    config = write_config(tmp, small_data)
    out = {}
    for name, nproc, extra in (("single", 1, ()), ("ddp", 2, ("--parallel.strategy", "ddp")),
                               ("fsdp", 2, ("--parallel.strategy", "fsdp"))):  # fmt: skip
        out[name] = (tmp / name, train(launcher, config, tmp / name, nproc, *extra))
    return out


def train_records(records: list[dict], key: str) -> np.ndarray:
    return np.array([r[key] for r in records if r["kind"] == "train"])


def test_single_process_mamba_trains(runs):
    losses = train_records(runs["single"][1], "loss")
    assert len(losses) == STEPS and np.isfinite(losses).all()
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_data_parallel_mamba_matches_single_process(runs, name):
    single, other = train_records(runs["single"][1], "loss"), train_records(runs[name][1], "loss")
    assert len(other) == STEPS
    np.testing.assert_allclose(other, single, rtol=0, atol=1e-5)
    np.testing.assert_allclose(train_records(runs[name][1], "grad_norm"),
                               train_records(runs["single"][1], "grad_norm"), rtol=1e-4)  # fmt: skip
    summary = json.loads((runs[name][0] / "summary.json").read_text())
    assert summary["strategy"] == name and summary["world_size"] == 2
    final = runs[name][0] / "checkpoints" / f"step_{STEPS:08d}"
    assert (final / "COMMITTED").is_file()
