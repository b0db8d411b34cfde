"""The debug Mamba-2 LM under real multi-process gloo: world 1 vs 2-process DDP, FSDP2 (with and without document
masking) and two pipeline stages agree to 1e-5."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.distributed.test_data_parallel import STEPS, train, write_config
from tests.distributed.test_mamba_parallel import train_records
from tests.unit import test_document_mask

many_documents = test_document_mask.many_documents  # 1,500 short documents: windows cross boundaries

MAMBA2 = ("--model.arch", "mamba2")  # the data-parallel test's recipe with the debug Mamba-2 flavour (chunk 8 of 32)
LAYOUTS = (("single", 1, ()), ("ddp", 2, ("--parallel.strategy", "ddp")), ("fsdp", 2, ("--parallel.strategy", "fsdp")))


class _Runs(dict):
    """name -> (run dir, records): a layout, or one with "-documents" (each document's state kept to itself), trained
    when a test first asks for it."""

    def __init__(self, tmp, config, many_documents):
        super().__init__()
        self.tmp, self.config, self.many_documents = tmp, config, many_documents

    def __missing__(self, key):
        name = key.removesuffix("-documents")
        nproc, extra = next((n, e) for layout, n, e in LAYOUTS if layout == name)
        if key != name:
            extra = (*extra, "--data.path", str(self.many_documents), "--data.document_mask", "true")
        self[key] = (self.tmp / key, train(self.config, self.tmp / key, nproc, *MAMBA2, *extra))
        return self[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_data, many_documents) -> _Runs:
    tmp = tmp_path_factory.mktemp("mamba2_dp")
    return _Runs(tmp, write_config(tmp, small_data), many_documents)


def test_single_process_mamba2_trains(runs):
    losses = train_records(runs["single"][1], "loss")
    assert len(losses) == STEPS and np.isfinite(losses).all()
    assert losses[-1] < losses[0]
    assert np.isfinite(train_records(runs["single-documents"][1], "loss")).all()


@pytest.mark.parametrize(
    ("name", "reference"), [("ddp", "single"), ("fsdp", "single"), ("fsdp-documents", "single-documents")]
)
def test_data_parallel_mamba2_matches_single_process(runs, name, reference):
    single, other = train_records(runs[reference][1], "loss"), train_records(runs[name][1], "loss")
    assert len(other) == STEPS
    np.testing.assert_allclose(other, single, rtol=0, atol=1e-5)
    np.testing.assert_allclose(
        train_records(runs[name][1], "grad_norm"), train_records(runs[reference][1], "grad_norm"), rtol=1e-4
    )
    summary = json.loads((runs[name][0] / "summary.json").read_text())
    assert summary["strategy"] == name.split("-")[0] and summary["world_size"] == 2
    assert (runs[name][0] / "checkpoints" / f"step_{STEPS:08d}" / "COMMITTED").is_file()


def test_mamba2_pipeline_matches_single_process(tmp_path, small_data):
    """Two pipeline stages (1F1B, untied embeddings) give the losses of one process."""
    config = write_config(tmp_path, small_data)
    untied = (*MAMBA2, "--model.args.tie_embeddings", "false", "--train.eval_batches", "0")
    single = train_records(train(config, tmp_path / "one", 1, *untied), "loss")
    piped = train_records(train(config, tmp_path / "pp2", 2, *untied, "--parallel.pp", "2"), "loss")
    assert len(piped) == STEPS
    np.testing.assert_allclose(piped, single, rtol=0, atol=1e-5)
