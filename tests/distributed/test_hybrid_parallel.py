"""The debug hybrid LM (pattern M-A-: a Mamba-2, an MLP, an attention and an MLP block) under real multi-process
gloo: world 1 vs 2-process DDP, FSDP2 and two pipeline stages agree to 1e-5."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.distributed.test_data_parallel import STEPS, train, write_config
from tests.distributed.test_mamba_parallel import train_records

HYBRID = ("--model.arch", "hybrid")  # the data-parallel test's recipe with the debug hybrid flavour (chunk 8 of 32)
LAYOUTS = (("single", 1, ()), ("ddp", 2, ("--parallel.strategy", "ddp")), ("fsdp", 2, ("--parallel.strategy", "fsdp")))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_data) -> dict[str, tuple[Path, list[dict]]]:
    tmp = tmp_path_factory.mktemp("hybrid_dp")
    config = write_config(tmp, small_data)
    return {name: (tmp / name, train(config, tmp / name, nproc, *HYBRID, *extra)) for name, nproc, extra in LAYOUTS}


def test_single_process_hybrid_trains(runs):
    losses = train_records(runs["single"][1], "loss")
    assert len(losses) == STEPS and np.isfinite(losses).all()
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_data_parallel_hybrid_matches_single_process(runs, name):
    single, other = train_records(runs["single"][1], "loss"), train_records(runs[name][1], "loss")
    assert len(other) == STEPS
    np.testing.assert_allclose(other, single, rtol=0, atol=1e-5)
    np.testing.assert_allclose(
        train_records(runs[name][1], "grad_norm"), train_records(runs["single"][1], "grad_norm"), rtol=1e-4
    )
    summary = json.loads((runs[name][0] / "summary.json").read_text())
    assert summary["strategy"] == name and summary["world_size"] == 2
    assert (runs[name][0] / "checkpoints" / f"step_{STEPS:08d}" / "COMMITTED").is_file()


def test_hybrid_pipeline_matches_single_process(runs, tmp_path, small_data):
    """Two pipeline stages (1F1B, untied embeddings: the debug flavour's default) give the losses of one process;
    the first stage holds the Mamba-2 block and its MLP, the second the attention block and its MLP."""
    config = write_config(tmp_path, small_data)
    piped = train_records(train(config, tmp_path / "pp2", 2, *HYBRID, "--parallel.pp", "2"), "loss")
    assert len(piped) == STEPS
    np.testing.assert_allclose(piped, train_records(runs["single"][1], "loss"), rtol=0, atol=1e-5)
