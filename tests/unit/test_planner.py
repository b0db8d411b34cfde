"""Planner: ranking, clear errors for impossible requests, the CLI command, and a monotonicity property."""

import json
import math
import random

import pytest
import typer
from typer.testing import CliRunner

from anytrain.cli.plan import plan_command
from anytrain.config import load_config
from anytrain.cost.devices import get_device
from anytrain.cost.model import MEGATRON, STRATEGIES, Layout, ModelShape, Workload, estimate
from anytrain.cost.planner import (
    RUNNABLE_STRATEGIES,
    NoFeasiblePlan,
    candidate_layouts,
    choose_layout,
    plan,
    size_job,
    trainer_overrides,
)
from anytrain.cost.shapes import parse_count, shape_from_config, shape_from_params
from anytrain.cost.tables import parse_duration
from anytrain.errors import ConfigError

LLAMA_7B = ModelShape(32, 4096, 32, 32, 11008, 32000)


def test_ranked_by_step_time_and_all_fit():
    result = plan(LLAMA_7B, get_device("h100"), 16, Workload(4096, 64))
    times = [e.step_s for e in result.ranked]
    assert all(e.fits for e in result.ranked)
    assert times[0] <= min(times) * 1.01
    assert result.recommended is result.ranked[0] and "fits" in result.reason


def test_model_that_fits_nowhere_names_the_smallest_change():
    with pytest.raises(NoFeasiblePlan) as info:
        plan(shape_from_params(175e9), get_device("h100"), 8, Workload(2048, 64), MEGATRON)
    message = str(info.value)
    assert isinstance(info.value, ConfigError)
    assert message.startswith("--gpus:") and "does not fit" in message and "smallest change: use --gpus" in message
    assert info.value.best is not None and not info.value.best.fits


def test_tp_larger_than_node_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"--tp: 16 is larger than --gpus-per-node 8"):
        plan(LLAMA_7B, get_device("h100"), 32, Workload(2048, 64), tp=16)


def test_pp_must_divide_layers():
    with pytest.raises(ConfigError, match=r"--pp: 5 does not divide the model's 32 layers"):
        plan(LLAMA_7B, get_device("h100"), 40, Workload(2048, 40), pp=5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(gpus=12), "--gpus: 12 is not a multiple of --gpus-per-node 8"),
        (dict(gpus=0), "--gpus: must be > 0"),
        (dict(gpus=8, batch=12), "--global-batch: 12 sequences cannot be split"),
    ],
)
def test_request_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        plan(LLAMA_7B, get_device("h100"), kwargs["gpus"], Workload(2048, kwargs.get("batch", 64)), tp=1, pp=1)


def test_tensor_parallel_stays_in_node_and_rest_is_data_parallel():
    result = plan(shape_from_params(175e9), get_device("h100"), 256, Workload(2048, 512), MEGATRON)
    best = result.recommended.layout
    assert best.tp <= 8 and best.world == 256
    assert all(e.layout.tp <= 8 for e in result.ranked)


def test_more_memory_never_makes_a_feasible_layout_infeasible():
    """Property (seeded random sweep instead of hypothesis): fits on M GiB => fits on M' > M GiB, per layout and
    for the plan as a whole."""
    rng = random.Random(0)
    for _ in range(40):
        layers = rng.choice([4, 8, 12, 24, 32])
        heads = rng.choice([8, 16, 32])
        dim = heads * rng.choice([64, 128])
        shape = ModelShape(layers, dim, heads, heads // rng.choice([1, 2, 4]), 4 * dim, rng.choice([32000, 128256]))
        gpus = rng.choice([1, 2, 4, 8, 16, 32])
        batch = gpus * rng.choice([1, 2, 4, 8])
        wl = Workload(rng.choice([512, 2048, 8192]), batch, compiled=rng.random() < 0.5)
        small = get_device(rng.choice(["a100-40", "h100", "mi250x"]), memory_gib=rng.uniform(4, 64))
        large = small.replace(memory_gib=small.memory_gib * rng.uniform(1.01, 4))
        layouts = candidate_layouts(shape, gpus, small.gpus_per_node, batch)
        for layout in rng.sample(layouts, k=min(5, len(layouts))):
            if estimate(shape, layout, wl, small).fits:
                assert estimate(shape, layout, wl, large).fits
        try:
            before = plan(shape, small, gpus, wl)
        except NoFeasiblePlan:
            continue
        after = plan(shape, large, gpus, wl)
        assert len(after.ranked) >= len(before.ranked)
        assert after.recommended.step_s <= before.recommended.step_s * 1.0000001


def test_choose_layout_for_the_trainer(tmp_path):
    cfg = load_config("configs/1.1b.yaml")
    choice = choose_layout(cfg, 8, get_device("h100"))
    assert choice["parallel.strategy"] in ("ddp", "fsdp") and choice["tp"] == 1 and choice["pp"] == 1
    assert (cfg.train.global_batch // 8) % choice["train.micro_batch"] == 0
    assert choice["predicted"]["required_gib"] <= 80
    single = choose_layout(cfg, 1, get_device("h200"))
    assert single["dp"] == 1 and single["train.micro_batch"] >= 1
    from anytrain import hardware

    spec = dict(hardware.DEVICE_CATALOGUE)["H100"]
    assert choose_layout(cfg, 8, spec)["parallel.strategy"] in ("ddp", "fsdp")
    assert choose_layout(cfg, 1, None)["predicted"] is None


def test_parse_count_and_shapes():
    assert parse_count("7e9") == 7e9 and parse_count("175B") == 175e9 and parse_count("1.5t") == 1.5e12
    with pytest.raises(ConfigError, match="--model"):
        parse_count("seven")
    shape = shape_from_params(7e9, layers=32, hidden=4096)
    assert abs(shape.num_params / 7e9 - 1) < 0.02
    assert shape_from_params(175e9).n_layers == 96
    with pytest.raises(ConfigError, match="--model"):
        shape_from_params(1e6, layers=32, hidden=4096)


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command()(plan_command)
    return app


def test_plan_command_json_from_config():
    result = CliRunner().invoke(_app(), ["--model", "configs/1.1b.yaml", "--gpu", "h200", "--gpus", "8", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["recommended"]["fits"] and data["model"]["params"] == 1100048384


def test_plan_command_table_from_param_count():
    args = [
        "--model",
        "13B",
        "--layers",
        "40",
        "--hidden",
        "5120",
        "--gpu",
        "a100-80",
        "--gpus",
        "16",
        "--global-batch",
        "64",
        "--price-per-gpu-hour",
        "2.0",
    ]
    result = CliRunner().invoke(_app(), args)
    assert result.exit_code == 0, result.output
    assert "recommended:" in result.output and "cost" in result.output


def test_layout_label():
    assert Layout(dp=16, tp=8, pp=4, strategy="zero1").label == "tp8·pp4·dp16 zero1"


def test_parallel_auto_in_the_trainer_keeps_cpu_choices_and_runs(tmp_path, small_data):
    """On CPU (no device spec) parallel.auto keeps the config's choices; the run proceeds."""
    from tests.conftest import run_cli

    proc = run_cli(
        "train",
        "configs/tiny.yaml",
        "--model.flavour",
        "debug",
        "--data.path",
        str(small_data),
        "--data.seq_len",
        "32",
        "--train.steps",
        "2",
        "--train.eval_batches",
        "0",
        "--parallel.auto",
        "true",
        "--run-dir",
        str(tmp_path / "auto"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_plan_command_defaults_to_layouts_the_trainer_runs():
    """Without --strategy the table holds only what `anytrain train` can run (ZeRO-2 appears as fsdp-noreshard);
    the analytical zero2 (replicated parameters) comes only when asked for."""
    base = ["--model", "configs/1.1b.yaml", "--gpu", "h200", "--gpus", "2", "--json"]
    default = json.loads(CliRunner().invoke(_app(), base).output)
    strategies = {row["strategy"] for row in default["ranked"]}
    assert "zero2" not in strategies and {"ddp", "zero1", "fsdp"} <= strategies
    asked = json.loads(CliRunner().invoke(_app(), [*base, "--strategy", "zero2"]).output)
    assert {row["strategy"] for row in asked["ranked"]} == {"zero2"}


def test_efficiency_table_is_an_option_not_the_environment(tmp_path, monkeypatch):
    """`anytrain plan --efficiency-table FILE` overrides the device figures; an environment variable does not."""
    table = tmp_path / "eff.json"
    table.write_text(json.dumps({"h200": {"efficiency": 0.123}}))
    monkeypatch.setenv("ANYTRAIN_EFFICIENCY_TABLE", str(table))
    assert get_device("h200").efficiency != pytest.approx(0.123)
    args = ["--model", "configs/1.1b.yaml", "--gpu", "h200", "--gpus", "8", "--json"]
    plain = CliRunner().invoke(_app(), args)
    tabled = CliRunner().invoke(_app(), [*args, "--efficiency-table", str(table)])
    assert plain.exit_code == 0 and tabled.exit_code == 0, plain.output + tabled.output
    assert json.loads(tabled.output)["device"]["efficiency"] == pytest.approx(0.123)
    assert json.loads(plain.output)["device"]["efficiency"] == pytest.approx(get_device("h200").efficiency)


# Job sizing: the two worked examples of docs/cost-model.md ("Job sizing").


def test_job_sizing_seed_example_175b_on_frontier_in_50_days():
    """GPT 175B on Frontier GCDs, 175B tokens, 50 days: 6·Ψ·D / (N · 191.5 TFLOP/s · 0.38) is 57.2 d at 512 GCDs
    (no count up to 512 can make it, whatever the layout) and 38.1 d at 768; the model's 41.1 d fits: 96 nodes."""
    shape = shape_from_params(175e9)
    device = get_device("frontier")
    sized = size_job(
        shape,
        device,
        Workload(2048, 1536, tokens=175e9),
        deadline_s=50 * 86400,
        max_gpus=3072,
        precision=MEGATRON,
        strategies=STRATEGIES,
    )
    assert (sized.gpus, sized.nodes) == (768, 96)
    bound_days = {
        n: 6 * shape.num_params * 175e9 / (n * device.peak_flops * device.efficiency) / 86400 for n in (512, 768)
    }
    assert bound_days[512] > 50 > bound_days[768]
    by_count = {row["gpus"]: row for row in sized.tried}
    assert by_count[512]["total_s"] > 50 * 86400 >= sized.best.total_s >= bound_days[768] * 86400
    assert max(by_count) == 768 and not by_count[48]["fits"]  # "fewest" stops at the first count that meets it
    assert "fewest devices that meet the deadline 50.0 d; 512 would take 61.7 d" in sized.reason


def test_job_sizing_1b_on_h200s_fewest_cheapest_and_budget():
    """1.1B recipe, 1e10 tokens in 24 h on H200s: one GPU needs 29.3 h even at the compute bound (7.31e19 model
    FLOPs at 989 TFLOP/s x 0.70), so two; with no deadline one GPU is the cheapest."""
    cfg = load_config("configs/1.1b.yaml")
    shape, device = shape_from_config(cfg), get_device("h200")
    wl = Workload(2048, 32, tokens=1e10)
    sized = size_job(shape, device, wl, deadline_s=24 * 3600, strategies=RUNNABLE_STRATEGIES)
    assert sized.gpus == 2 and sized.best.steps == 152_588 and sized.best.total_s <= 24 * 3600
    one_gpu_bound_h = 1e10 * shape.flops_per_token(2048) / (device.peak_flops * device.efficiency) / 3600
    assert 29 < one_gpu_bound_h < 30 and sized.tried[0]["total_s"] > one_gpu_bound_h * 3600
    overrides = trainer_overrides(sized.best)
    assert overrides[:2] == ["--parallel.strategy", "fsdp"] and overrides[-2:] == ["--train.steps", "152588"]
    # a recipe's parallel.tp_sequence_loss would be refused at this layout's tp 1: the overrides turn it off
    assert "--parallel.tp_sequence_loss" in overrides and load_config("configs/1.1b.yaml", overrides)
    cheapest = size_job(shape, device, wl, objective="cheapest", max_gpus=16, strategies=RUNNABLE_STRATEGIES)
    assert cheapest.gpus == 1 and len(cheapest.tried) == 5
    with pytest.raises(ConfigError, match=r"^--budget-gpu-hours: 38 device-hours are too few; .* 2 devices"):
        size_job(shape, device, wl, deadline_s=24 * 3600, budget_gpu_hours=38, strategies=RUNNABLE_STRATEGIES)
    with pytest.raises(ConfigError, match=r"^--deadline: no device count up to --max-gpus 8 finishes in 1.0 h"):
        size_job(shape, device, wl, deadline_s=3600, max_gpus=8, strategies=RUNNABLE_STRATEGIES)


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("36h", 129600),
        ("30d", 2592000),
        ("90min", 5400),
        ("45m", 2700),
        ("600s", 600),
        ("2-00:00:00", 172800),
        ("04:30:00", 16200),
        ("90", 5400),  # SLURM's forms, as sbatch reads them: a bare number is minutes
        ("90:30", 5430),
        ("1-12", 129600),
        ("1-12:30", 131400),
    ],
)
def test_deadline_formats(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["1:2:3:4", "1-", "-5", "36 hours", "1.5:00", "unlimited"])
def test_a_duration_that_is_none_of_the_forms_or_does_not_end_is_one_line(text):
    with pytest.raises(ConfigError, match=r"^--deadline: "):
        parse_duration(text)


def test_slurm_time_forms_agree_with_the_launcher():
    """One parser: every form `anytrain launch slurm --time` accepts is a duration `--nodes auto` can size for."""
    from anytrain.cost.tables import slurm_time_seconds

    assert [slurm_time_seconds(t) for t in ("60", "60:30", "2:00:00", "1-2", "1-2:30", "1-2:30:15")] == [
        3600.0,
        3630.0,
        7200.0,
        93600.0,
        95400.0,
        95415.0,
    ]
    assert slurm_time_seconds("INFINITE") == math.inf
    assert slurm_time_seconds(" 60") is None and slurm_time_seconds("60\n") is None  # the text goes into #SBATCH


def test_plan_cli_sizes_the_job_and_prints_the_sbatch_line():
    args = ["--model", "configs/1.1b.yaml", "--gpu", "h200", "--tokens", "1e10", "--deadline", "24h"]
    result = CliRunner().invoke(_app(), args)
    assert result.exit_code == 0, result.output
    assert "sbatch: anytrain launch slurm configs/1.1b.yaml --nodes 1 --gpus-per-node 2 --time 0-20:57:00 --" in (
        result.output
    )
    missing = CliRunner().invoke(_app(), args[:4])
    assert missing.exit_code != 0 and "--gpus: give the device count, or --deadline" in str(missing.exception)
    assert "not a duration" in str(CliRunner().invoke(_app(), [*args[:-1], "soon"]).exception)
