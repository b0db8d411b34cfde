"""Tensor parallelism (alone, with FSDP, inside pipeline stages) on real gloo processes; more pipeline layouts in
test_pipeline.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests.distributed.test_data_parallel import STEPS, losses, train, write_config

LAYOUTS = {
    # compiled blocks, as the GPU recipes run TP (eager TP: test_transformer_options_tp.py); the row-parallel
    # embedding's in-flight reduce-scatter must not reach a compiled block (torch 2.13 broke its backward)
    "tp2": (2, ("--parallel.tp", "2", "--train.compile", "true")),
    "dp2_tp2": (4, ("--parallel.tp", "2", "--parallel.strategy", "fsdp")),
    "pp2_tp2": (4, ("--parallel.pp", "2", "--parallel.tp", "2")),  # TP inside each pipeline stage
    # the LM head and the loss on each TP rank's sequence shard, its weight's gradient summed over the TP group
    "tp2_seq_loss": (2, ("--parallel.tp", "2", "--train.compile", "true", "--parallel.tp_sequence_loss", "true")),
    "dp2_tp2_seq_loss": (
        4,
        ("--parallel.tp", "2", "--parallel.strategy", "fsdp", "--parallel.tp_sequence_loss", "true"),
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_data):
    """(tmp, config, run(name) -> (run dir, records)): each layout trains once, when a test first asks for it."""
    tmp = tmp_path_factory.mktemp("mp")
    config = write_config(tmp, small_data)
    done = {}

    def run(name):
        if name not in done:
            nproc, extra = (1, ()) if name == "single" else LAYOUTS[name]
            done[name] = (tmp / name, train(config, tmp / name, nproc, "--train.eval_batches", "0", *extra))
        return done[name]

    return tmp, config, run


# the sequence-parallel loss entries slow: test_transformer_options_tp.py's
# test_tp2_sequence_loss_with_a_tied_head_matches_single_process_in_training_and_eval checks that loss at tp 2
@pytest.mark.parametrize(
    "name",
    [
        "tp2",
        "dp2_tp2",
        pytest.param("tp2_seq_loss", marks=pytest.mark.slow),
        pytest.param("dp2_tp2_seq_loss", marks=pytest.mark.slow),
        pytest.param("pp2_tp2", marks=pytest.mark.slow),
    ],
)
def test_first_losses_match_single_process(runs, name):
    _, _, run = runs
    single, other = losses(run("single")[1]), losses(run(name)[1])
    assert len(other) == STEPS
    np.testing.assert_allclose(other, single, rtol=0, atol=1e-4)
    grads = [[r["grad_norm"] for r in run(k)[1] if r["kind"] == "train"] for k in ("single", name)]
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-3)


@pytest.mark.slow  # four-process runs twice; resharding across layouts stays in the default run in test_pipeline.py
def test_dp2_tp2_checkpoint_resumes_at_dp4(runs):
    tmp, config, run = runs
    mid = tmp / "tp_mid"
    train(
        config,
        mid,
        4,
        "--train.eval_batches",
        "0",
        "--parallel.tp",
        "2",
        "--parallel.strategy",
        "fsdp",
        "--train.stop_at_step",
        "3",
    )
    train(config, mid, 4, "--train.eval_batches", "0", "--parallel.strategy", "fsdp", "--resume")
    resumed = losses(train_records(mid))
    reference = losses(run("dp2_tp2")[1])
    np.testing.assert_allclose(resumed[-2:], reference[-2:], rtol=0, atol=1e-5)


def train_records(run_dir):
    import json

    by_step = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def test_impossible_layouts_fail_clearly(runs, tmp_path):
    _, config, _ = runs
    from tests.conftest import run_cli

    proc = run_cli(
        "train", str(config), "--parallel.tp", "4", "--parallel.dp_shard", "1", "--run-dir", str(tmp_path / "x")
    )
    assert proc.returncode == 2 and "error: parallel: pp=1 x dp_replicate=1 x dp_shard=1 x tp=4 = 4" in proc.stderr
    assert not (tmp_path / "x").exists()
