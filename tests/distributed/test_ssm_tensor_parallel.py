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
def runs(tmp_path_factory, small_data, many_documents):
    """run(name, layout) -> the run directory of case ``name`` in one process ("single") or at tp 2 ("tp2"), trained
    when a test first asks for it."""
    tmp = tmp_path_factory.mktemp("ssm_tp")
    config = write_config(tmp, small_data, STEPS, INTERVAL)
    # two groups (B, C and the norm split by groups) with each document's state kept to itself
    groups = ("--model.arch", "mamba2", "--model.args.ngroups", "2", "--data.path", str(many_documents))
    cases = {**CASES, "mamba2-groups-documents": (*groups, "--data.document_mask", "true")}
    done: dict[str, Path] = {}

    def run(name: str, layout: str) -> Path:
        key = f"{name}-{layout}"
        if key not in done:
            nproc, tp = (1, ()) if layout == "single" else (2, ("--parallel.tp", "2"))
            done[key] = tmp / key
            train(config, tmp / key, nproc, *cases[name], *tp)
        return done[key]

    return run


# "mamba2" (one group) slow: the hybrid's Mamba-2 mixers have one group too (the same shard_mixer), and the grouped
# case runs the mamba2 architecture's plan
@pytest.mark.parametrize("name", [pytest.param("mamba2", marks=pytest.mark.slow), "hybrid", "mamba2-groups-documents"])
def test_tensor_parallel_gives_the_single_process_losses(runs, name):
    single, tp2 = step_losses(runs(name, "single")), step_losses(runs(name, "tp2"))
    assert sorted(tp2) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([tp2[s] for s in sorted(tp2)], [single[s] for s in sorted(tp2)], rtol=0, atol=1e-5)
    summary = json.loads((runs(name, "tp2") / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["config"]["parallel"]["tp"] == 2
    assert (runs(name, "tp2") / "checkpoints" / f"step_{STEPS:08d}" / "COMMITTED").is_file()


@pytest.mark.parametrize(
    ("name", "source", "nproc", "tp"),
    [
        pytest.param("mamba2", "tp2", 1, (), marks=pytest.mark.slow),  # the hybrid's tp 2 -> 1 below
        ("hybrid", "tp2", 1, ()),
        ("hybrid", "single", 2, ("--parallel.tp", "2")),
    ],
)
def test_a_checkpoint_resumes_at_the_other_tensor_parallel_degree(runs, tmp_path, small_data, name, source, nproc, tp):
    """tp 2 -> one process and one process -> tp 2: the steps after the checkpoint repeat."""
    config = write_config(tmp_path, small_data, STEPS, INTERVAL)
    ref = runs(name, source)
    run = tmp_path / "resumed"
    shutil.copytree(ref, run)
    shutil.rmtree(run / "checkpoints" / f"step_{STEPS:08d}")
    proc = train(config, run, nproc, "--resume", *CASES[name], *tp)
    assert f"step_{INTERVAL:08d}" in proc.stderr
    resumed, expected = step_losses(run), step_losses(ref)
    for step in range(INTERVAL + 1, STEPS + 1):
        assert abs(resumed[step] - expected[step]) <= 1e-5, (step, resumed[step], expected[step])


COMM_PROBE = """
import json, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from anytrain.config import ModelConfig
from anytrain.models import build_model, spec_of
dist.init_process_group("gloo")
mesh, out = init_device_mesh("cpu", (2,)), {}
for arch in ("mamba2", "hybrid"):
    torch.manual_seed(0)
    model = build_model(ModelConfig(arch=arch, flavour="debug"))
    spec_of(model).parallelize_plan.tensor_parallel(model, mesh)
    tokens = torch.randint(0, 100, (2, 32))
    shapes, plain = [], dist.all_reduce
    dist.all_reduce = lambda t, *a, **k: (shapes.append(list(t.shape)), plain(t, *a, **k))[1]
    with CommDebugMode() as mode:
        model(tokens, tokens).backward()
    dist.all_reduce = plain
    counts = {str(op): n for op, n in mode.get_comm_counts().items()}
    out[arch] = {"dtensor_all_reduce": counts.get("c10d_functional.all_reduce", 0), "plain": shapes}
if dist.get_rank() == 0:
    open(sys.argv[1], "w").write(json.dumps(out))
dist.destroy_process_group()
"""


def test_the_cost_model_counts_the_collectives_tensor_parallel_blocks_issue(tmp_path):
    """One forward + backward of the debug Mamba-2 and hybrid LMs at tp 2 (batch 2 x 32 positions, one micro-batch)
    on 2 gloo ranks, its collectives counted (DTensor's through CommDebugMode, the gated norm's plain all-reduces by
    their shapes), against the cost model's TP all-reduces for that layout: a·b·s·d ones per block, b·s·G ones per
    Mamba-2 mixer (one group spans both ranks)."""
    from anytrain.config import ModelConfig, RunConfig
    from anytrain.cost.devices import get_device
    from anytrain.cost.model import Layout, Workload, estimate
    from anytrain.cost.shapes import shape_from_config
    from tests import forklaunch
    from tests.conftest import ROOT, cli_env

    script, result = tmp_path / "probe.py", tmp_path / "counts.json"
    script.write_text(COMM_PROBE)
    # two ranks as torchrun starts them (its launch variables), forked from the pre-imported server
    proc = forklaunch.run([str(result)], cli_env(False), ROOT, nproc=2, timeout=300, main=str(script))
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(result.read_text())
    for arch, got in measured.items():
        shape = shape_from_config(RunConfig(model=ModelConfig(arch=arch, flavour="debug")))
        est = estimate(shape, Layout(tp=2, micro_batch=2, strategy="single"), Workload(32, 2), get_device("h200"))
        by_msg = {c.message_bytes / 2: c.count for c in est.comm if c.axis == "tp" and c.collective == "all_reduce"}
        mamba = shape if arch == "mamba2" else shape.mamba
        assert got["dtensor_all_reduce"] == by_msg[2 * 32 * shape.dim], arch  # bf16 messages in the model: / 2 bytes
        assert all(s == [2, 32, mamba.ngroups] for s in got["plain"]), got["plain"]
        assert len(got["plain"]) == by_msg[2 * 32 * mamba.ngroups * 2], arch  # fp32 sums of squares: 4 bytes / 2
