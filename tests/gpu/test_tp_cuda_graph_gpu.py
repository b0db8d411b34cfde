"""train.cuda_graphs under tensor parallelism alone, on 2 GPUs: the captured micro-steps (their DTensor collectives
included) train like the eager ones (run on a lent machine with 2+ GPUs: pytest -m gpu tests/gpu)."""

import json

import pytest
import torch

from tests.conftest import run_cli

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def _train(run_dir, small_data, graphs: bool) -> tuple[list[float], dict, str]:
    proc = run_cli(
        "train",
        "configs/tiny.yaml",
        "--model.flavour",
        "debug",
        "--data.path",
        str(small_data),
        "--data.seq_len",
        "64",
        "--train.global_batch",
        "8",
        "--train.micro_batch",
        "4",
        "--train.steps",
        "8",
        "--train.log_interval",
        "1",
        "--train.lr",
        "1e-2",
        "--train.warmup_steps",
        "0",
        "--train.dtype",
        "fp32",
        "--train.compile",
        "true",
        "--parallel.tp",
        "2",
        "--train.cuda_graphs",
        str(graphs).lower(),
        "--checkpoint.interval",
        "0",
        "--run-dir",
        str(run_dir),
        "--device",
        "gpu",
        gpu=True,
        nproc=2,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r["kind"] == "train"]
    return losses, json.loads((run_dir / "summary.json").read_text()), proc.stdout + proc.stderr


def test_tensor_parallel_graph_replay_trains_like_eager(tmp_path, small_data):
    """TP2 with compiled blocks, fp32: the graphed run replays every micro-batch after the first capture (8 steps x 2
    micro-batches), its losses equal the eager run's to float rounding and fall."""
    eager, _, _ = _train(tmp_path / "eager", small_data, False)
    graphed, summary, out = _train(tmp_path / "graphs", small_data, True)
    assert "eager micro-steps" not in out
    assert summary["cuda_graph_replays"] == 8 * 2
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=1e-4, atol=1e-4)
    assert graphed[-1] < graphed[0]
