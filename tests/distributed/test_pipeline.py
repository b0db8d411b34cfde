"""Pipeline parallelism (1F1B, GPipe, Interleaved1F1B, InterleavedZeroBubble, with FSDP) and ZeRO-1 on real gloo
processes, against the single-process run of the same 4-layer debug model; checkpoints moving between these layouts."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from tests.conftest import run_cli
from tests.distributed.test_data_parallel import STEPS, losses, train, write_config

FOUR_LAYERS = ("--model.args.n_layers", "4", "--train.eval_batches", "1", "--train.eval_interval", "0")
LAYOUTS = {  # name: (processes, extra arguments)
    "pp2_1f1b": (2, ("--parallel.pp", "2")),
    "pp2_v2_interleaved": (
        2,
        ("--parallel.pp", "2", "--parallel.pp_schedule", "Interleaved1F1B", "--parallel.pp_virtual_stages", "2"),
    ),
    "pp2_v2_zerobubble": (
        2,
        ("--parallel.pp", "2", "--parallel.pp_schedule", "InterleavedZeroBubble", "--parallel.pp_virtual_stages", "2"),
    ),
    "dp2_pp2_gpipe_fsdp": (4, ("--parallel.pp", "2", "--parallel.pp_schedule", "GPipe", "--parallel.strategy", "fsdp")),
    "zero1": (2, ("--parallel.strategy", "zero1")),
}


class _Runs(dict):
    """name -> (run dir, records): "single" or a layout, trained when a test first asks for it."""

    def __init__(self, tmp, config):
        super().__init__()
        self.tmp, self.config = tmp, config

    def __missing__(self, name):
        nproc, extra = (1, ()) if name == "single" else LAYOUTS[name]
        self[name] = (self.tmp / name, train(self.config, self.tmp / name, nproc, *FOUR_LAYERS, *extra))
        return self[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_data):
    tmp = tmp_path_factory.mktemp("pp")
    config = write_config(tmp, small_data)
    return tmp, config, _Runs(tmp, config)


def records(metrics: list[dict], kind: str, key: str) -> np.ndarray:
    return np.array([r[key] for r in metrics if r["kind"] == kind])


# Interleaved1F1B slow: the virtual stages (two model chunks per rank) run under InterleavedZeroBubble, the same
# stage split with the split backward on top
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "pp2_v2_interleaved" else n for n in LAYOUTS]
)
def test_first_losses_match_single_process(runs, name):
    _, _, out = runs
    single, other = losses(out["single"][1]), losses(out[name][1])
    assert len(other) == STEPS and single[-1] < single[0]
    np.testing.assert_allclose(other, single, rtol=0, atol=1e-4)
    np.testing.assert_allclose(
        records(out[name][1], "train", "grad_norm"), records(out["single"][1], "train", "grad_norm"), rtol=1e-4
    )
    # validation (stage-by-stage forward under PP) sees the same weights and data
    np.testing.assert_allclose(
        records(out[name][1], "eval", "val_loss"), records(out["single"][1], "eval", "val_loss"), rtol=0, atol=1e-4
    )
    summary = json.loads((out[name][0] / "summary.json").read_text())
    assert summary["world_size"] == LAYOUTS[name][0]
    assert (out[name][0] / "checkpoints" / f"step_{STEPS:08d}" / "COMMITTED").is_file()


def train_records(run_dir) -> list[dict]:
    by_step = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            by_step[record["step"]] = record  # a resumed run logs steps after the checkpoint again
    return [by_step[s] for s in sorted(by_step)]


@pytest.mark.parametrize(
    "first, then",
    [
        ((4, ("--parallel.pp", "2", "--parallel.strategy", "fsdp")), (1, ())),  # dp2 x pp2 (FSDP) -> one process
        pytest.param(
            (2, ("--parallel.strategy", "zero1")),
            (2, ("--parallel.pp", "2")),  # ZeRO-1 (sharded state) -> pp2
            marks=pytest.mark.slow,
        ),
    ],
)
def test_checkpoint_resumes_at_another_layout(runs, tmp_path, first, then):
    _, config, out = runs
    run = tmp_path / "moved"
    train(config, run, first[0], *FOUR_LAYERS, *first[1], "--train.stop_at_step", "3")
    train(config, run, then[0], *FOUR_LAYERS, *then[1], "--resume")
    resumed = losses(train_records(run))
    assert len(resumed) == STEPS
    np.testing.assert_allclose(resumed[3:], losses(out["single"][1])[3:], rtol=0, atol=1e-5)


def test_mamba_pipeline_matches_single_process(runs, tmp_path):
    _, config, _ = runs
    mamba = ("--model.arch", "mamba", "--model.args.tie_embeddings", "false", "--train.eval_batches", "0")
    single = losses(train(config, tmp_path / "m1", 1, *mamba))
    piped = losses(train(config, tmp_path / "m2", 2, *mamba, "--parallel.pp", "2"))
    np.testing.assert_allclose(piped, single, rtol=0, atol=1e-4)


def launch(config, run_dir, *args: str, **env: str) -> subprocess.CompletedProcess:
    """Two ranks, whatever the outcome (for runs that must fail)."""
    argv = ("train", str(config), "--run-dir", str(run_dir), *FOUR_LAYERS, *args)
    return run_cli(*argv, nproc=2, timeout=300, **env)


def test_nan_on_the_last_stage_stops_every_stage(runs, tmp_path):
    _, config, _ = runs
    proc = launch(
        config, tmp_path / "nan", "--parallel.pp", "2", ANYTRAIN_TEST_NAN_AT_STEP="3", ANYTRAIN_TEST_NAN_RANK="1"
    )
    assert proc.returncode != 0
    assert proc.stderr.count("step 3: non-finite loss or gradient norm") == 2  # both stages, same verdict
    assert (tmp_path / "nan" / "checkpoints" / "step_00000002" / "COMMITTED").is_file()


def test_too_few_micro_batches_fail_clearly(runs, tmp_path):
    _, config, _ = runs
    proc = launch(config, tmp_path / "x", "--parallel.pp", "2", "--train.micro_batch", "8")
    assert proc.returncode != 0  # each rank exits 2; torchrun reports the failure as 1
    # The check runs after init_process_group but before any collective, so nothing holds the ranks together: torchrun
    # stops the slower rank as soon as the first exits, sometimes before it has printed (CI saw one line).
    assert proc.stderr.count("error: train.micro_batch: 1 micro-batches per step for 2 pipeline ranks") >= 1
    assert not (tmp_path / "x").exists()


def test_zero1_checkpoint_holds_each_rank_s_half_of_the_optimizer_state(runs):
    """DCP records which rank wrote which rows: ZeRO-1 moments are two dim-0 shards, the parameters one full copy."""
    from torch.distributed.checkpoint import FileSystemReader

    _, _, out = runs
    meta = FileSystemReader(str(out["zero1"][0] / "checkpoints" / f"step_{STEPS:08d}")).read_metadata()
    entries = meta.state_dict_metadata
    key = "train.optim.state.layers.0.feed_forward.w1.weight.exp_avg"
    chunks = sorted((c.offsets[0], c.sizes[0]) for c in entries[key].chunks)
    rows = entries[key].size[0]
    assert chunks == [(0, rows // 2), (rows // 2, rows // 2)]
    assert len(entries["train.model.layers.0.feed_forward.w1.weight"].chunks) == 1
