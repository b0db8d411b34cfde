"""Training on a real GPU (run on a lent machine: pytest -m gpu tests/gpu)."""

import json

import pytest
import torch

from tests.conftest import run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]


@pytest.mark.parametrize("recipe", ["tiny.yaml", "tiny-mamba2.yaml", "tiny-hybrid.yaml"])
def test_bf16_training_on_gpu(tmp_path, small_data, recipe):
    """The Transformer, Mamba-2 (Triton SSD and conv) and hybrid debug models train in bf16 with falling loss."""
    run_dir = tmp_path / "gpu"
    proc = run_cli(
        "train",
        f"configs/{recipe}",
        "--model.flavour",
        "debug",
        "--data.path",
        str(small_data),
        "--data.seq_len",
        "64",
        "--train.steps",
        "30",
        "--train.log_interval",
        "10",
        "--run-dir",
        str(run_dir),
        "--device",
        "gpu",
        gpu=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dtype"] == "bfloat16" and summary["hardware"]["vendor"] in ("cuda", "rocm")
    assert summary["mfu"] is not None and 0 < summary["mfu"] < 1
    assert summary["final_val_loss"] < summary["first_val_loss"]
    assert summary["peak_mem_gib"] > 0
    assert summary["step_checks"] == "lagged"  # fused AdamW on the GPU: the per-step checks never block the host


def test_lagged_nan_check_on_gpu_keeps_the_state_before_the_bad_step(tmp_path, small_data):
    """The lagged path's device side (pinned copies, the event, found_inf in the fused CUDA/ROCm kernel): a NaN at
    step 6 is read at step 7, and the run stops with step 5's checkpoint, finite, and nothing after it."""
    run_dir = tmp_path / "nan"
    proc = run_cli(
        "train",
        "configs/tiny.yaml",
        "--model.flavour",
        "debug",
        "--data.path",
        str(small_data),
        "--data.seq_len",
        "64",
        "--train.steps",
        "12",
        "--train.log_interval",
        "10",
        "--train.eval_batches",
        "0",
        "--checkpoint.interval",
        "0",
        "--run-dir",
        str(run_dir),
        "--device",
        "gpu",
        gpu=True,
        ANYTRAIN_TEST_NAN_AT_STEP="6",
    )
    assert proc.returncode != 0 and "step 6: non-finite loss or gradient norm" in proc.stderr, proc.stderr[-3000:]
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert saved == ["step_00000005"]


def test_memory_snapshot_of_a_profiled_step(tmp_path, small_data):
    """profile.memory_snapshot on the real allocator: the pickle is written and the replayed peak lies between the
    memory held before the step and the run's allocator peak."""
    import pickle

    run_dir = tmp_path / "mem"
    args = ["configs/tiny.yaml", "--model.flavour", "debug", "--data.path", str(small_data), "--data.seq_len", "64"]
    args += ["--train.steps", "4", "--profile.steps", "1", "--profile.start_step", "2", "--profile.memory_snapshot"]
    proc = run_cli("train", *args, "true", "--run-dir", str(run_dir), "--device", "gpu", gpu=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(run_dir / "profile" / "rank0.memory_snapshot.pickle", "rb") as f:  # written by this test's run
        snapshot = pickle.load(f)  # noqa: S301
    assert snapshot["device_traces"] and snapshot["device_traces"][0]
    peak = json.loads((run_dir / "profile" / "rank0.json").read_text())["memory_peak"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0 < peak["baseline_gib"] < peak["peak_gib"] <= summary["peak_mem_gib"] * 1.01
    assert peak["top"] and any("anytrain" in r["site"] for r in peak["top"])
