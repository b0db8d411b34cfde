import pytest

from anytrain.config import BatchPlan, RunConfig, load_config, parse_overrides, plan_batches
from anytrain.errors import ConfigError


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(write(tmp_path, "train:\n  steps: 5\n"), ["--train.lr", "3e-4", "--model.args.dim=64"])
    assert isinstance(cfg, RunConfig)
    assert cfg.train.steps == 5 and cfg.train.lr == 3e-4 and cfg.model.args == {"dim": 64}
    assert cfg.name == "c"


def test_int_accepted_for_float_field(tmp_path):
    assert load_config(write(tmp_path, "train:\n  lr: 1\n")).train.lr == 1.0


@pytest.mark.parametrize(
    "text, overrides, message",
    [
        ("train:\n  stepz: 3\n", [], "train.stepz: unknown field"),
        ("", ["--train.steps", "ten"], "train.steps: expected an integer, got 'ten'"),
        ("", ["--train.steps", "2.5"], "train.steps: expected an integer"),
        ("", ["--train.compile", "maybe"], "train.compile: expected true/false"),
        ("", ["--train.schedule", "linear"], "train.schedule: expected one of"),
        ("", ["--train.steps", "0"], "train.steps: must be > 0"),
        ("", ["--train.min_lr_ratio", "1.5"], "train.min_lr_ratio"),
        ("bogus: 1\n", [], "bogus: unknown field"),
        ("- a list\n", [], "expected a mapping"),
        ("", ["--train.steps"], "--train.steps: missing value"),
        ("", ["train.steps", "3"], "expected an override"),
        (
            "parallel: {strategy: ddp}\n",
            ["--parallel.reshard_during_accumulation", "false"],
            "parallel.reshard_during_accumulation: false applies to FSDP only, but the strategy is ddp",
        ),
        (
            "parallel: {strategy: ddp}\n",
            ["--parallel.fsdp_group_blocks", "2"],
            "parallel.fsdp_group_blocks applies to FSDP only, but the strategy is ddp",
        ),
        ("", ["--parallel.fsdp_group_blocks", "0"], "parallel.fsdp_group_blocks: expected >= 1, got 0"),
    ],
)
def test_config_errors_name_the_field(tmp_path, text, overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("'", ".")):
        load_config(write(tmp_path, text), overrides)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_parse_overrides_nested():
    assert parse_overrides(["--a.b.c", "1", "--a.b.d", "x", "--e=true"]) == {"a": {"b": {"c": 1, "d": "x"}}, "e": True}


def test_batch_plan():
    cfg = RunConfig()
    cfg.train.global_batch, cfg.train.micro_batch = 32, 4
    assert plan_batches(cfg.train, 2) == BatchPlan(32, 2, 4, 4)
    cfg.train.micro_batch = 0
    assert plan_batches(cfg.train, 4) == BatchPlan(32, 4, 8, 1)
    cfg.train.micro_batch = 3
    with pytest.raises(ConfigError, match="not divisible by world size x micro_batch"):
        plan_batches(cfg.train, 2)
    cfg.train.global_batch = 10
    with pytest.raises(ConfigError, match="train.global_batch: 10 is not divisible by the data-parallel world size 4"):
        plan_batches(cfg.train, 4)
