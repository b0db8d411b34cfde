import re

import pytest

from anytrain.config import BatchPlan, RunConfig, load_config, parse_overrides, plan_batches
from anytrain.data.resolve import resolve_run_config
from anytrain.errors import ConfigError, DataError


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
        ("", ["--model.init_device", "gpu"], "model.init_device: expected one of"),
        (
            "",
            ["--parallel.async_tp", "true"],
            "parallel.async_tp: overlaps tensor-parallel collectives inside compiled "
            "blocks, so it needs --parallel.tp >= 2 and --train.compile true",
        ),
        (
            "",
            ["--parallel.async_tp", "true", "--parallel.tp", "2", "--train.compile", "false"],
            "got tp 2, compile false",
        ),
        ("", ["--parallel.tp_sequence_loss", "true"], "parallel.tp_sequence_loss: scores each tensor-parallel rank"),
        (
            "",
            ["--parallel.tp_sequence_loss", "true", "--parallel.tp", "2", "--parallel.pp", "2"],
            "got tp 2, pp 2",
        ),
        (
            "data: {seq_len: 33}\n",
            ["--parallel.tp_sequence_loss", "true", "--parallel.tp", "2"],
            "got tp 2, pp 1, seq_len 33",
        ),
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


NUMERIC_BAD_VALUES = [
    ("parallel.ddp_bucket_mb", "0", "parallel.ddp_bucket_mb: expected a size in MB > 0, got 0.0"),
    ("parallel.nccl_min_ctas", "-2", "parallel.nccl_min_ctas: expected a thread-block count >= 0"),
    ("parallel.nccl_max_ctas", "-1", "parallel.nccl_max_ctas: expected a thread-block count >= 0"),
    ("train.steps", "0", "train.steps: must be > 0"),
    ("train.global_batch", "0", "train.global_batch: must be > 0"),
    ("train.micro_batch", "-1", "train.micro_batch: must be >= 0"),
    ("train.micro_batch", "64", "train.micro_batch: 64 is larger than train.global_batch 32"),
    ("train.lr", ".nan", "train.lr: must be a finite number, got nan"),
    ("train.lr", "inf", "train.lr: must be a finite number, got inf"),
    ("train.lr", "-1e-3", "train.lr: must be > 0"),
    ("train.min_lr_ratio", "1.5", "train.min_lr_ratio: must be in [0.0, 1.0]"),
    ("train.warmup_steps", "-1", "train.warmup_steps: must be >= 0"),
    ("train.decay_fraction", "0", "train.decay_fraction: must be in (0.0, 1.0]"),
    ("train.weight_decay", "-0.1", "train.weight_decay: must be >= 0"),
    ("train.beta1", "1.5", "train.beta1: must be in [0.0, 1.0), got 1.5"),
    ("train.beta2", "1.0", "train.beta2: must be in [0.0, 1.0), got 1.0"),
    ("train.eps", "-1", "train.eps: must be > 0, got -1"),
    ("train.grad_clip", "-.inf", "train.grad_clip: must be a finite number"),
    ("train.stop_at_step", "-1", "train.stop_at_step: must be >= 0"),
    ("train.seed", "-1", "train.seed: must be in [0, 9223372036854775807]"),
    ("train.log_interval", "0", "train.log_interval: must be > 0"),
    ("train.eval_interval", "-1", "train.eval_interval: must be >= 0"),
    ("train.eval_batches", "-1", "train.eval_batches: must be >= 0"),
    ("train.spike_factor", "0.5", "train.spike_factor: must be 0 (off) or > 1"),
    ("train.gc_interval", "-1", "train.gc_interval: must be >= 0"),
    ("train.peak_tflops", "-1", "train.peak_tflops: must be >= 0"),
    ("data.seq_len", "0", "data.seq_len: must be > 0"),
    ("data.seq_len", "1000000000", "data.seq_len: 1000000000 exceeds model.args.max_seq_len 512"),
    ("model.args.max_seq_len", "1000000000", "model.args.max_seq_len: must be in [1, 1048576]"),
    ("model.args.rope_theta", ".nan", "model.args.rope_theta: must be a finite number"),
    ("parallel.dp_replicate", "0", "parallel.dp_replicate: must be >= 1"),
    ("parallel.dp_shard", "0", "parallel.dp_shard: must be >= 1 or -1"),
    ("parallel.tp", "0", "parallel.tp: must be >= 1"),
    ("parallel.pp", "-1", "parallel.pp: must be >= 1"),
    ("parallel.pp_virtual_stages", "0", "parallel.pp_virtual_stages: must be >= 1"),
    ("parallel.fsdp_group_blocks", "0", "parallel.fsdp_group_blocks: expected >= 1"),
    ("parallel.powersgd_start_step", "1", "parallel.powersgd_start_step: must be 0 (= train.warmup_steps) or >= 2"),
    ("checkpoint.interval", "-1", "checkpoint.interval: must be >= 0"),
    ("checkpoint.interval_minutes", ".nan", "checkpoint.interval_minutes: must be a finite number"),
    ("checkpoint.keep_last", "0", "checkpoint.keep_last: must be > 0"),
    ("profile.steps", "-1", "profile.steps: must be >= 0"),
    ("profile.start_step", "-1", "profile.start_step: must be >= 0"),
]


@pytest.mark.parametrize("key, value, message", NUMERIC_BAD_VALUES)
def test_every_numeric_field_refuses_values_outside_its_domain(tmp_path, key, value, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        resolve_run_config(load_config(write(tmp_path, "model: {flavour: tiny}\n"), [f"--{key}", value]))


def test_load_config_reads_no_model_code_and_the_resolve_step_checks_the_model():
    """load_config checks the config alone; the family's args (and the prepared data) are checked right after."""
    cfg = load_config(None, ["--model.args.max_seq_len", "1000000000", "--model.args.dimm", "3"])
    assert cfg.model.args == {"max_seq_len": 1000000000, "dimm": 3}
    with pytest.raises(ConfigError, match=r"^model\.args\.dimm: unknown field"):
        resolve_run_config(cfg)


def test_the_bad_value_table_covers_every_numeric_config_field():
    import dataclasses
    import typing

    from anytrain import config

    numeric = set()
    for section in ("data", "train", "parallel", "checkpoint", "profile"):
        cls = typing.get_type_hints(config.RunConfig)[section]
        for name, tp in typing.get_type_hints(cls).items():
            if tp in (int, float) and name in {f.name for f in dataclasses.fields(cls)}:
                numeric.add(f"{section}.{name}")
    assert numeric - {key for key, _, _ in NUMERIC_BAD_VALUES} == set()


def test_data_path_is_recorded_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(write(tmp_path, "data: {path: data/x}\n"))
    assert cfg.data.path == str(tmp_path / "data" / "x")
    assert load_config(None, ["--data.path", "/abs/y"]).data.path == "/abs/y"


def test_seq_len_longer_than_the_prepared_data_is_refused_when_the_config_is_resolved(tmp_path):
    import numpy as np

    from anytrain.data.shards import ShardWriter, write_index

    writer = ShardWriter(tmp_path, "train", np.dtype(np.uint16))
    writer.write(np.arange(100))
    writer.close()
    write_index(tmp_path, np.dtype(np.uint16), 200, 0, {"train": writer.shards, "val": writer.shards})
    resolve_run_config(load_config(None, ["--data.path", str(tmp_path), "--data.seq_len", "99"]))
    cfg = load_config(None, ["--data.path", str(tmp_path), "--data.seq_len", "100"])
    with pytest.raises(DataError, match=r"^data.seq_len: 100 is too long for the train split .*longest shard 100"):
        resolve_run_config(cfg)
