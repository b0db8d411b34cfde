"""``profile.memory_snapshot``: the peak replayed from an allocator trace (the format of
``torch.cuda.memory._snapshot()["device_traces"]``, written out here because a CPU has no caching allocator to record;
the GPU test runs the real one) and the refusals on a CPU run and without profiled steps."""

import pytest

from anytrain.config import load_config
from anytrain.errors import ConfigError
from anytrain.train.profiling import format_summary, memory_peak
from anytrain.train.trainer import Trainer

MIB = 2**20


def frame(line: int, name: str, filename: str = "/site/anytrain/models/mamba2/model.py") -> dict:
    return {"filename": filename, "line": line, "name": name}


def test_the_peak_is_the_largest_live_set_summed_by_the_allocating_line():
    torch_frame = frame(10, "empty", "/site/torch/_ops.py")
    trace = [
        {"action": "alloc", "addr": 1, "size": 64 * MIB, "frames": [torch_frame, frame(5, "forward")]},
        {"action": "alloc", "addr": 2, "size": 32 * MIB, "frames": [frame(5, "forward")]},
        {"action": "alloc", "addr": 3, "size": 16 * MIB, "frames": [frame(9, "ssd")]},  # the peak: 112 MiB
        {"action": "free_requested", "addr": 1, "size": 64 * MIB},
        {"action": "free_completed", "addr": 1, "size": 64 * MIB},  # ends nothing twice
        {"action": "alloc", "addr": 4, "size": 40 * MIB, "frames": []},  # 88 MiB: below the peak
        {"action": "segment_alloc", "addr": 9, "size": 512 * MIB},  # reserved, not allocated
    ]
    peak = memory_peak(trace, baseline=1024 * MIB)
    assert peak["recorded_peak_gib"] == pytest.approx(112 / 1024)
    assert peak["peak_gib"] == pytest.approx(1 + 112 / 1024)
    sites = [(r["site"], r["gib"] * 1024, r["blocks"]) for r in peak["top"]]
    assert sites == [
        ("/site/anytrain/models/mamba2/model.py:5 forward", pytest.approx(96), 2),  # the anytrain frame, not torch's
        ("/site/anytrain/models/mamba2/model.py:9 ssd", pytest.approx(16), 1),
    ]
    summary = {"kernel_ms": 0.0, "kinds": {}, "top": [], "memory_peak": peak}
    summary["timeline"] = {"span_ms": 0.0, "idle_ms": 0.0, "comm_ms": 0.0, "comm_exposed_ms": 0.0}
    assert "memory: peak 1.11 GiB (1.00 held before)" in format_summary(summary, "t")


def test_a_cpu_run_or_no_profiled_step_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="profile.memory_snapshot: records the profiled steps"):
        load_config(None, ["--profile.memory_snapshot", "true", "--profile.steps", "0"])
    cfg = load_config(None, ["--profile.memory_snapshot", "true", "--profile.steps", "1", "--device", "cpu"])
    with pytest.raises(ConfigError, match="profile.memory_snapshot: the allocator's history exists on CUDA/ROCm"):
        Trainer(cfg, run_dir=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # nothing written
