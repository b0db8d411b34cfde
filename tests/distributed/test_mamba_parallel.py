"""The debug Mamba LM under real multi-process gloo: world 1 vs 2-process DDP vs 2-process FSDP2 agree to 1e-5."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.distributed.test_data_parallel import STEPS, train, write_config

MAMBA = ("--model.arch", "mamba")  # the data-parallel test's recipe with the debug Mamba flavour


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_data) -> dict[str, tuple[Path, list[dict]]]:
    tmp = tmp_path_factory.mktemp("mamba_dp")
    config = write_config(tmp, small_data)
    out = {}
    for name, nproc, extra in (
        ("single", 1, ()),
        ("ddp", 2, ("--parallel.strategy", "ddp")),
        ("fsdp", 2, ("--parallel.strategy", "fsdp")),
    ):
        out[name] = (tmp / name, train(config, tmp / name, nproc, *MAMBA, *extra))
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
    np.testing.assert_allclose(
        train_records(runs[name][1], "grad_norm"), train_records(runs["single"][1], "grad_norm"), rtol=1e-4
    )
    summary = json.loads((runs[name][0] / "summary.json").read_text())
    assert summary["strategy"] == name and summary["world_size"] == 2
    final = runs[name][0] / "checkpoints" / f"step_{STEPS:08d}"
    assert (final / "COMMITTED").is_file()
