"""The analysis half of bench/scaling.py and bench/cost_model_validation.py on synthetic rows (no GPU needed)."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import cost_model_validation  # noqa: E402
import scaling  # noqa: E402


def _row(case: scaling.Case, tokens_per_s_per_gpu: float, peak: float) -> dict:
    return {**asdict(case), "dp": case.dp, "accum": case.accum, "tokens_per_s": tokens_per_s_per_gpu * case.gpus,
            "tokens_per_s_per_gpu": tokens_per_s_per_gpu, "peak_mem_gib": peak}  # fmt: skip


def test_efficiencies_use_the_matching_one_gpu_baseline():
    cases = {c.name: c for c in scaling.default_cases(4)}
    rows = [
        _row(cases["t-1-g32"], 1000.0, 30.0),
        _row(cases["t-1-g8"], 900.0, 30.0),
        _row(cases["t-fsdp-2-g32"], 950.0, 20.0),
        _row(cases["t-fsdp-2-g16"], 880.0, 20.0),
        _row(cases["t-tp2-2-g32"], 700.0, 20.0),
        _row(cases["hf-ddp-1-g8"], 500.0, 40.0),
        _row(cases["hf-ddp-2-g16"], 450.0, 40.0),
    ]
    scaling.add_efficiencies(rows)
    by = {r["name"]: r for r in rows}
    assert by["t-fsdp-2-g32"]["strong_efficiency"] == pytest.approx(0.95)  # vs the 1-GPU run of the same global batch
    assert by["t-fsdp-2-g16"]["weak_efficiency"] == pytest.approx(880 / 900)  # vs 1 GPU with the same per-GPU batch
    assert by["t-tp2-2-g32"]["weak_efficiency"] is None  # dp != gpus: no weak-scaling partner
    assert by["hf-ddp-2-g16"]["weak_efficiency"] == pytest.approx(0.9)  # HF against HF
    assert by["t-fsdp-2-g16"]["vs_hf_ddp_same_gpus"] == pytest.approx(880 / 450)


def test_cost_layout_maps_case_layouts():
    cases = {c.name: c for c in scaling.default_cases(4)}
    hsdp = scaling.cost_layout(asdict(cases["t-hsdp2x2-4-g32"]) | {"dp": 4})
    assert (hsdp.strategy, hsdp.dp, hsdp.shard_size) == ("hsdp", 4, 2)
    tp_fsdp = scaling.cost_layout(asdict(cases["t-tp2-fsdp2-4-g32"]))
    assert (tp_fsdp.strategy, tp_fsdp.dp, tp_fsdp.tp) == ("fsdp", 2, 2)
    single = scaling.cost_layout(asdict(cases["t-1-g32"]))
    assert (single.strategy, single.dp) == ("ddp", 1)
    assert scaling.cost_layout(asdict(cases["t-tp4-4-g32"])).strategy == "ddp"  # dp 1: nothing to shard


def test_validation_calibrates_on_one_run_and_predicts_the_rest():
    cases = {c.name: c for c in cost_model_validation.default_cases()}
    rows = [_row(cases["t-1-g32"], 70000.0, 34.0), _row(cases["t-fsdp-2-g32"], 66000.0, 22.0),
            _row(cases["v-125m-1"], 450000.0, 14.0)]  # fmt: skip
    table = cost_model_validation.predict(rows, "h200", 4, "t-1-g32")
    calib, fsdp, small = (r["predicted"] for r in rows)
    assert calib["calibration_run"] and calib["step_error"] == pytest.approx(0.0, abs=1e-9)
    assert 0.2 < table["h200"]["efficiency"] < 0.8  # 70k tok/s on the 1.1B model is ~51% MFU
    # FSDP on 2 GPUs: half the compute per GPU plus some exposed communication; 125m: a real prediction, not the fit
    assert fsdp["compute_s"] == pytest.approx(calib["compute_s"] / 2, rel=0.1)  # bf16 residual: less traffic
    assert not small["calibration_run"] and small["allocated_gib"] > 0
    with pytest.raises(SystemExit, match="calibration run"):
        cost_model_validation.predict([_row(cases["v-125m-1"], 1.0, 1.0)], "h200", 4, "t-1-g32")
