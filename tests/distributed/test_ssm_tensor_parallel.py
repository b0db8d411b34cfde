"""The debug Mamba-2 and hybrid LMs under 2-rank gloo tensor parallelism (each mixer split over its heads,
``models/mamba2/parallelize.py``): the losses of one process, and DCP checkpoints that resume at the other TP degree
with the same next losses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.distributed.test_fault_tolerance import step_losses, train, write_config
from tests.unit import test_document_mask

many_documents = test_document_mask.many_documents  # 1,500 short documents: windows cross boundaries

STEPS, INTERVAL = 6, 3
CASES = {
    "mamba2": ("--model.arch", "mamba2"),  # one group: B, C replicated, the gated norm's squares summed over ranks
    "hybrid": ("--model.arch", "hybrid"),  # M-A-: a Mamba-2 mixer, attention and two MLPs split
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_data, many_documents) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("ssm_tp")
    config = write_config(tmp, small_data, STEPS, INTERVAL)
    # two groups (B, C and the norm split by groups) with each document's state kept to itself
    groups = ("--model.arch", "mamba2", "--model.args.ngroups", "2", "--data.path", str(many_documents))
    cases = {**CASES, "mamba2-groups-documents": (*groups, "--data.document_mask", "true")}
    out = {}
    for name, extra in cases.items():
        for layout, nproc, tp in (("single", 1, ()), ("tp2", 2, ("--parallel.tp", "2"))):
            out[f"{name}-{layout}"] = run = tmp / f"{name}-{layout}"
            train(config, run, nproc, *extra, *tp)
    return out


@pytest.mark.parametrize("name", [*CASES, "mamba2-groups-documents"])
def test_tensor_parallel_gives_the_single_process_losses(runs, name):
    single, tp2 = step_losses(runs[f"{name}-single"]), step_losses(runs[f"{name}-tp2"])
    assert sorted(tp2) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([tp2[s] for s in sorted(tp2)], [single[s] for s in sorted(tp2)], rtol=0, atol=1e-5)
    summary = json.loads((runs[f"{name}-tp2"] / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["config"]["parallel"]["tp"] == 2
    assert (runs[f"{name}-tp2"] / "checkpoints" / f"step_{STEPS:08d}" / "COMMITTED").is_file()


@pytest.mark.parametrize(
    ("name", "source", "nproc", "tp"), [("mamba2", "tp2", 1, ()), ("hybrid", "single", 2, ("--parallel.tp", "2"))]
)
def test_a_checkpoint_resumes_at_the_other_tensor_parallel_degree(runs, tmp_path, small_data, name, source, nproc, tp):
    """tp 2 -> one process (mamba2) and one process -> tp 2 (hybrid): the steps after the checkpoint repeat."""
    config = write_config(tmp_path, small_data, STEPS, INTERVAL)
    ref = runs[f"{name}-{source}"]
    run = tmp_path / "resumed"
    shutil.copytree(ref, run)
    shutil.rmtree(run / "checkpoints" / f"step_{STEPS:08d}")
    proc = train(config, run, nproc, "--resume", *CASES[name], *tp)
    assert f"step_{INTERVAL:08d}" in proc.stderr
    resumed, expected = step_losses(run), step_losses(ref)
    for step in range(INTERVAL + 1, STEPS + 1):
        assert abs(resumed[step] - expected[step]) <= 1e-5, (step, resumed[step], expected[step])
