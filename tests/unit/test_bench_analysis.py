"""The analysis of the scaling study (bench/scaling_analysis.py) and bench/cost_model_validation.py on synthetic rows
(no GPU needed), and the bench recipe rows against their configs."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from bench import cost_model_validation, scaling, scaling_analysis, scaling_cases
from tests.conftest import ROOT


def _row(case: scaling_cases.Case, tokens_per_s_per_gpu: float, peak: float) -> dict:
    return {
        **asdict(case),
        "dp": case.dp,
        "accum": case.accum,
        "tokens_per_s": tokens_per_s_per_gpu * case.gpus,
        "tokens_per_s_per_gpu": tokens_per_s_per_gpu,
        "peak_mem_gib": peak,
    }


def test_efficiencies_use_the_matching_one_gpu_baseline():
    cases = {c.name: c for c in scaling_cases.default_cases(4)}
    rows = [
        _row(cases["t-1-g32"], 1000.0, 30.0),
        _row(cases["t-1-g8"], 900.0, 30.0),
        _row(cases["t-fsdp-2-g32"], 950.0, 20.0),
        _row(cases["t-fsdp-2-g16"], 880.0, 20.0),
        _row(cases["t-tp2-2-g32"], 700.0, 20.0),
        _row(cases["t-tp2mb16-2-g32"], 800.0, 40.0),
        _row(cases["hf-ddp-1-g8"], 500.0, 40.0),
        _row(cases["hf-ddp-2-g16"], 450.0, 40.0),
    ]
    scaling_analysis.add_efficiencies(rows)
    by = {r["name"]: r for r in rows}
    assert by["t-fsdp-2-g32"]["strong_efficiency"] == pytest.approx(0.95)  # vs the 1-GPU run of the same global batch
    assert by["t-fsdp-2-g16"]["weak_efficiency"] == pytest.approx(880 / 900)  # vs 1 GPU with the same per-GPU batch
    assert by["t-tp2-2-g32"]["weak_efficiency"] is None  # dp != gpus: no weak-scaling partner
    # micro-batch 16 does not fit one GPU: a model-parallel row falls back to the 1-GPU row at its own micro-batch
    assert by["t-tp2mb16-2-g32"]["strong_ref"] == "t-1-g32" and by["t-tp2mb16-2-g32"]["strong_efficiency"] == 0.8
    assert by["t-fsdp-2-g16"]["strong_ref"] is None  # data-parallel rows keep the strict same-shape rule
    assert by["hf-ddp-2-g16"]["weak_efficiency"] == pytest.approx(0.9)  # HF against HF
    assert by["t-fsdp-2-g16"]["vs_hf_ddp_same_gpus"] == pytest.approx(880 / 450)


def test_efficiency_baselines_match_the_model_shape():
    cases = {c.name: c for c in scaling_cases.default_cases(4)}
    rows = [
        _row(cases["t-1-g32"], 1000.0, 30.0),
        _row(cases["v-tiny-1"], 250000.0, 0.4),
        _row(cases["t-fsdp-2-g32"], 950.0, 20.0),
        _row(cases["m-fsdp-2-g32"], 400.0, 40.0),
        _row(cases["hf-ddp-2-g16"], 450.0, 40.0),
    ]
    scaling_analysis.add_efficiencies(rows)
    by = {r["name"]: r for r in rows}
    # v-tiny-1 is a 1-GPU "transformer" row of global batch 16 = t-fsdp-2-g32's per-GPU batch, but another model
    assert by["t-fsdp-2-g32"]["weak_efficiency"] is None and by["t-fsdp-2-g32"]["weak_ref"] is None
    assert by["t-fsdp-2-g32"]["strong_ref"] == "t-1-g32"
    # HF + DDP runs the 1.1B Transformer: no ratio for Mamba; another global batch is flagged
    assert by["m-fsdp-2-g32"]["vs_hf_ddp_same_gpus"] is None
    assert by["t-fsdp-2-g32"]["vs_hf_ddp_ref"] == "hf-ddp-2-g16"
    assert by["t-fsdp-2-g32"]["vs_hf_ddp_batch_matched"] is False


def test_merge_prefers_later_rows_but_never_an_error_over_a_measurement():
    cases = {c.name: c for c in scaling_cases.default_cases(4)}
    fail = lambda name: {**asdict(cases[name]), "error": "exit 1: boom"}  # noqa: E731
    first = {
        "device": "NVIDIA H200",
        "gpus_on_host": 2,
        "date": "d1",
        "rows": [
            _row(cases["t-1-g32"], 1000.0, 30.0) | {"strong_efficiency": 0.5, "predicted": {"x": 1}},
            _row(cases["t-fsdp-2-g32"], 900.0, 20.0),
            fail("hf-ddp-2-g16"),
            fail("t-tp2-2-g32"),
        ],
    }
    second = {
        "device": "NVIDIA H200",
        "gpus_on_host": 2,
        "date": "d2",
        "rows": [
            fail("t-1-g32"),
            _row(cases["t-fsdp-2-g32"], 950.0, 21.0),
            _row(cases["hf-ddp-2-g16"], 450.0, 40.0),
            {**fail("t-tp2-2-g32"), "error": "exit 2: later"},
        ],
    }
    third = {"device": "NVIDIA H200", "gpus_on_host": 4, "date": "d3", "rows": [_row(cases["t-fsdp-4-g32"], 800, 18)]}
    rows = scaling_analysis.merge_rows([("a.json", first), ("b.json", second), ("c.json", third)])
    by = {r["name"]: r for r in rows}
    assert by["t-1-g32"]["source"] == "a.json"  # the later failure does not replace the measurement ...
    assert by["t-1-g32"]["other_runs"] == [{"source": "b.json", "error": "exit 1: boom"}]  # ... but is recorded
    assert "strong_efficiency" not in by["t-1-g32"] and "predicted" not in by["t-1-g32"]  # derived: recomputed
    assert by["t-fsdp-2-g32"]["tokens_per_s_per_gpu"] == 950.0 and by["t-fsdp-2-g32"]["source"] == "b.json"
    assert by["t-fsdp-2-g32"]["other_runs"] == [{"source": "a.json", "tokens_per_s_per_gpu": 900.0}]
    assert by["hf-ddp-2-g16"]["source"] == "b.json" and "error" not in by["hf-ddp-2-g16"]  # a rerun fixes a failure
    assert by["t-tp2-2-g32"]["error"] == "exit 2: later"  # error over error: the later one
    assert (by["t-fsdp-4-g32"]["machine"], by["t-fsdp-4-g32"]["date"]) == ("4x NVIDIA H200", "d3")
    assert [r["name"] for r in rows] == ["t-1-g32", "t-fsdp-2-g32", "t-tp2-2-g32", "t-fsdp-4-g32", "hf-ddp-2-g16"]
    scaling_analysis.add_efficiencies(rows)
    assert by["t-fsdp-4-g32"]["strong_efficiency"] == pytest.approx(0.8)  # against the 1-GPU row of another file


def test_merge_takes_the_median_of_one_hosts_runs():
    """Files from one host (one machine lease) hold repeats of a case: the merged row is the median run (the lower
    middle one for an even count) with every rate; a file from another host replaces them as before."""
    cases = {c.name: c for c in scaling_cases.default_cases(4)}

    def payload(host, rate, date="d1"):
        return {
            "device": "NVIDIA H100",
            "gpus_on_host": 4,
            "date": date,
            "host": host,
            "rows": [_row(cases["t-ddp-4-g32"], rate, 33.0)],
        }

    same = [("a.json", payload("h1", 900.0)), ("b.json", payload("h1", 1000.0)), ("c.json", payload("h1", 950.0))]
    (row,) = scaling_analysis.merge_rows(same)
    assert row["tokens_per_s_per_gpu"] == 950.0 and row["source"] == "c.json"
    assert row["repeat_tokens_per_s_per_gpu"] == [900.0, 1000.0, 950.0] and row["host"] == "h1"
    (even,) = scaling_analysis.merge_rows(same[:2])
    assert even["tokens_per_s_per_gpu"] == 900.0 and even["repeat_tokens_per_s_per_gpu"] == [900.0, 1000.0]
    (other,) = scaling_analysis.merge_rows([*same, ("d.json", payload("h2", 700.0, "d2"))])
    assert other["tokens_per_s_per_gpu"] == 700.0 and other["source"] == "d.json"
    assert [r["tokens_per_s_per_gpu"] for r in other["other_runs"]] == [900.0, 1000.0, 950.0]
    (unknown,) = scaling_analysis.merge_rows([("a.json", payload(None, 900.0)), ("b.json", payload(None, 1000.0))])
    assert unknown["tokens_per_s_per_gpu"] == 1000.0  # files without a host: the later row, as before


def test_cost_layout_maps_case_layouts():
    cases = {c.name: c for c in scaling_cases.default_cases(4)}
    hsdp = scaling_analysis.cost_layout(asdict(cases["t-hsdp2x2-4-g32"]) | {"dp": 4})
    assert (hsdp.strategy, hsdp.dp, hsdp.shard_size) == ("hsdp", 4, 2)
    tp_fsdp = scaling_analysis.cost_layout(asdict(cases["t-tp2-fsdp2-4-g32"]))
    assert (tp_fsdp.strategy, tp_fsdp.dp, tp_fsdp.tp) == ("fsdp", 2, 2)
    single = scaling_analysis.cost_layout(asdict(cases["t-1-g32"]))
    assert (single.strategy, single.dp) == ("ddp", 1)
    assert scaling_analysis.cost_layout(asdict(cases["t-tp4-4-g32"])).strategy == "ddp"  # dp 1: nothing to shard
    # the row's own options reach the layout: gathered FSDP, ZeRO-2, the interleaved schedule
    assert not scaling_analysis.cost_layout(asdict(cases["t-fsdpg-4-g32"])).reshard_during_accumulation
    assert scaling_analysis.cost_layout(asdict(cases["t-fsdp-4-g32"])).reshard_during_accumulation
    assert not scaling_analysis.cost_layout(asdict(cases["t-zero2-4-g32"])).reshard_after_forward
    pp4i = scaling_analysis.cost_layout(asdict(cases["t-pp4i-4-g32"]))
    assert (pp4i.pp, pp4i.pp_schedule, pp4i.pp_chunks) == (4, "interleaved", 2)
    assert scaling_analysis.cost_layout(asdict(cases["t-pp4-4-g32"])).pp_schedule == "1f1b"


def test_validation_calibrates_on_one_run_and_predicts_the_rest():
    cases = {c.name: c for c in cost_model_validation.default_cases()}
    rows = [
        _row(cases["t-1-g32"], 70000.0, 34.0),
        _row(cases["t-fsdp-2-g32"], 66000.0, 22.0),
        _row(cases["v-125m-1"], 450000.0, 14.0),
    ]
    table = cost_model_validation.predict(rows, "h200", 4, "t-1-g32")
    calib, fsdp, small = (r["predicted"] for r in rows)
    assert calib["calibration_run"] and calib["step_error"] == pytest.approx(0.0, abs=1e-9)
    assert 0.2 < table["h200"]["efficiency"] < 0.8  # 70k tok/s on the 1.1B model is ~51% MFU
    # FSDP on 2 GPUs: half the compute per GPU plus some exposed communication; 125m: a real prediction, not the fit
    assert fsdp["compute_s"] == pytest.approx(calib["compute_s"] / 2, rel=0.1)  # bf16 residual: less traffic
    assert not small["calibration_run"] and small["allocated_gib"] > 0
    with pytest.raises(SystemExit, match="calibration run"):
        cost_model_validation.predict([_row(cases["v-125m-1"], 1.0, 1.0)], "h200", 4, "t-1-g32")


def test_plot_series_keeps_option_variants_apart_and_drops_profiled_rows():
    cases = {c.name: c for c in scaling_cases.default_cases(4)}
    rows = [
        _row(cases[n], tps, 20.0)
        for n, tps in (
            ("t-1-g32", 1000.0),
            ("t-fsdp-4-g32", 850.0),
            ("t-fsdpg-4-g32", 930.0),
            ("t-fsdp-2-g32", 900.0),
            ("t-fsdpg-2-g32", 970.0),
            ("p-fsdp-2-g16", 500.0),
        )
    ]
    scaling_analysis.add_efficiencies(rows)
    series = {s["label"]: [r["name"] for r in s["rows"]] for s in scaling_analysis.plot_series(rows, "transformer")}
    assert series["FSDP, 32 seq global"] == ["t-1-g32", "t-fsdp-2-g32", "t-fsdp-4-g32"]
    assert series["FSDP gathered, 32 seq global"] == ["t-1-g32", "t-fsdpg-2-g32", "t-fsdpg-4-g32"]
    assert not any("p-fsdp-2-g16" in names for names in series.values())
    assert scaling.tag_suffix("4gpu") == "_4gpu" and scaling.tag_suffix("_x") == "_x" and scaling.tag_suffix("") == ""


def test_eight_gpu_cases_exist_and_pair_with_one_gpu_baselines():
    cases = {c.name: c for c in scaling_cases.default_cases(8)}
    assert not any(c.gpus == 8 for c in scaling_cases.default_cases(4))
    assert cases["t-fsdp-8-g32"].accum == 1  # the goal row: one micro-batch of 4 per GPU
    assert cases["t-fsdpg-8-g64"].accum == 2 and cases["t-hsdp2x4-8-g32"].dp_replicate == 2
    rows = [
        _row(cases[n], tps, 20.0)
        for n, tps in (
            ("t-1-g32", 1000.0),
            ("t-1-g8", 950.0),
            ("hf-ddp-1-g8", 600.0),
            ("t-fsdp-8-g32", 900.0),
            ("t-fsdpg-8-g64", 920.0),
            ("hf-ddp-8-g64", 560.0),
        )
    ]
    scaling_analysis.add_efficiencies(rows)
    by = {r["name"]: r for r in rows}
    assert by["t-fsdp-8-g32"]["strong_ref"] == "t-1-g32" and by["t-fsdp-8-g32"]["strong_efficiency"] == 0.9
    assert by["t-fsdpg-8-g64"]["weak_ref"] == "t-1-g8" and by["hf-ddp-8-g64"]["weak_ref"] == "hf-ddp-1-g8"
    assert by["t-fsdpg-8-g64"]["vs_hf_ddp_ref"] == "hf-ddp-8-g64"


@pytest.mark.parametrize(
    "row,config",
    [("1.4b-recipe", "mamba-1.4b.yaml"), ("1.4b-mb16", "mamba-1.4b-mb16.yaml"), ("130m", "mamba-130m.yaml")],
)
def test_mamba_bench_recipe_rows_match_their_configs(row, config):
    # bench/mamba_train.py's recipe rows say they run configs/<config> as configured: keep them in step with the file
    from anytrain.config import load_config
    from bench import mamba_train

    case = {c.name: c for c in mamba_train.default_cases()}[row]
    cfg = load_config(ROOT / "configs" / config)
    assert (case.flavour, case.seq, case.micro, case.global_batch) == (
        cfg.model.flavour,
        cfg.data.seq_len,
        cfg.train.micro_batch,
        cfg.train.global_batch,
    )
    assert (case.compile, case.graphs) == (cfg.train.compile, cfg.train.cuda_graphs)
    assert case.scope == cfg.train.compile_scope
    assert dict(case.model_args) == cfg.model.args


def test_transformer_bench_recipe_row_matches_its_config():
    from anytrain.config import load_config
    from bench import transformer as transformer_bench

    case = next(c for c in transformer_bench.default_cases() if c.label.startswith("anytrain recipe"))
    cfg = load_config(ROOT / "configs" / "1.1b.yaml")
    assert (case.flavour, case.seq, case.micro, case.global_batch) == (
        cfg.model.flavour,
        cfg.data.seq_len,
        cfg.train.micro_batch,
        cfg.train.global_batch,
    )
    assert case.options.get("train.compile_scope", "blocks") == cfg.train.compile_scope and cfg.train.compile


def test_a_row_the_cost_model_cannot_take_keeps_the_others_predicted():
    cases = {c.name: c for c in scaling_cases.default_cases(4)}
    good = _row(cases["t-tp4mb16-4-g32"], 28000.0, 20.0)
    bad = {**_row(cases["t-pp4-4-g32"], 48000.0, 18.0), "extra": ["--parallel.pp_schedule", "Bogus"]}
    rows = [_row(cases["t-1-g32"], 71000.0, 29.0), good, bad]
    scaling_analysis.add_predictions(rows, "h100", 4)
    assert "parallel.pp_schedule" in bad["predicted"]["catalogue"]["error"]
    assert good["predicted"]["calibrated"]["step_s"] > 0 and "step_error" in good["predicted"]["catalogue"]


def test_repeats_run_round_robin_and_fold_into_the_median_run():
    cases = {c.name: c for c in scaling_cases.default_cases(4)}
    runs = scaling.with_repeats([cases["t-1-g32"], cases["t-ddp-4-g32"]], 3)
    assert [c.name for c in runs] == [
        "t-1-g32",
        "t-ddp-4-g32",
        "t-1-g32#2",
        "t-ddp-4-g32#2",
        "t-1-g32#3",
        "t-ddp-4-g32#3",
    ]
    rows = [
        {**_row(c, rate, peak), "name": c.name}
        for c, rate, peak in zip(runs, (70, 60, 72, 62, 71, 10), range(6), strict=True)
    ]
    rows[5] = {"name": "t-ddp-4-g32#3", "error": "exit 1"}
    by = {r["name"]: r for r in scaling.aggregate_repeats(rows)}
    assert by["t-1-g32"]["tokens_per_s_per_gpu"] == 71 and by["t-1-g32"]["peak_mem_gib"] == 4  # the median run's row
    assert by["t-1-g32"]["repeat_tokens_per_s_per_gpu"] == [70, 72, 71]
    assert by["t-ddp-4-g32"]["tokens_per_s_per_gpu"] == 60 and by["t-ddp-4-g32"]["repeats_failed"] == 1  # lower middle
    failed = scaling.aggregate_repeats([{"name": "x", "error": "a"}, {"name": "x#2", "error": "b"}])
    assert failed == [{"name": "x", "error": "a"}]
