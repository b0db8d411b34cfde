"""Training options that must not change the maths: activation checkpointing, per-block torch.compile, profiling."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from tests.conftest import run_cli


def losses(run_dir):
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return np.array([r["loss"] for r in records if r["kind"] == "train"])


def train(small_data, run_dir, *extra):
    proc = run_cli(
        "train",
        "configs/tiny.yaml",
        "--model.flavour",
        "debug",
        "--data.path",
        str(small_data),
        "--data.seq_len",
        "32",
        "--train.global_batch",
        "4",
        "--train.steps",
        "4",
        "--train.log_interval",
        "1",
        "--train.eval_batches",
        "0",
        "--train.dtype",
        "fp32",
        "--run-dir",
        str(run_dir),
        "--checkpoint.save_final",
        "false",
        *extra,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses(run_dir)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, small_data):
    return train(small_data, tmp_path_factory.mktemp("opt") / "base")


def test_activation_checkpointing_gives_the_same_losses(baseline, small_data, tmp_path):
    with_ac = train(small_data, tmp_path / "ac", "--train.activation_checkpointing", "full")
    np.testing.assert_allclose(with_ac, baseline, rtol=0, atol=1e-6)


# per-block compile of the same debug Transformer against its eager losses (1e-4) is test_model_parallel.py's tp2
# entry (compiled blocks, as the GPU recipes run TP)
@pytest.mark.slow
def test_compiled_blocks_give_the_same_losses(baseline, small_data, tmp_path):
    compiled = train(small_data, tmp_path / "compiled", "--train.compile", "true")
    np.testing.assert_allclose(compiled, baseline, rtol=0, atol=1e-4)


def test_whole_model_compile_gives_the_same_losses(baseline, small_data, tmp_path):
    compiled = train(
        small_data, tmp_path / "compiled_model", "--train.compile", "true", "--train.compile_scope", "model"
    )
    np.testing.assert_allclose(compiled, baseline, rtol=0, atol=1e-4)


@pytest.mark.slow  # the Transformer case of the same mechanism stays in make test
def test_whole_model_compile_of_mamba_gives_the_same_losses(small_data, tmp_path):
    def mamba(run_dir, *extra):
        proc = run_cli(
            "train",
            "configs/tiny-mamba.yaml",
            "--data.path",
            str(small_data),
            "--data.seq_len",
            "16",
            "--train.global_batch",
            "2",
            "--train.steps",
            "3",
            "--train.log_interval",
            "1",
            "--train.eval_batches",
            "0",
            "--train.dtype",
            "fp32",
            "--run-dir",
            str(run_dir),
            "--model.args.n_layers",
            "2",
            "--checkpoint.save_final",
            "false",
            *extra,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return losses(run_dir)

    eager = mamba(tmp_path / "eager")
    compiled = mamba(tmp_path / "compiled", "--train.compile", "true", "--train.compile_scope", "model")
    np.testing.assert_allclose(compiled, eager, rtol=0, atol=1e-4)


def test_whole_model_compile_refuses_data_parallelism(small_data, tmp_path):
    # checked before any process group is needed: a clear error naming the field and the fix
    import torch

    from anytrain.config import load_config
    from anytrain.errors import ConfigError
    from anytrain.models import build_model
    from anytrain.parallel import parallelize
    from anytrain.parallel.mesh import ParallelDims

    cfg = load_config(None, ["--model.flavour", "debug", "--train.compile", "true", "--train.compile_scope", "model"])
    dims = ParallelDims.from_config(cfg.parallel, world_size=2)
    with pytest.raises(ConfigError, match="train.compile_scope"):
        parallelize(build_model(cfg.model), cfg, dims, torch.device("cpu"), torch.float32)
    # one process: the body is wrapped by torch.compile, the blocks are not compiled one by one
    model, _ = parallelize(
        build_model(cfg.model),
        cfg,
        ParallelDims.from_config(cfg.parallel, world_size=1),
        torch.device("cpu"),
        torch.float32,
    )
    assert hasattr(model.forward_hidden, "_torchdynamo_orig_callable")
    mcfg = load_config(
        None,
        [
            "--model.arch",
            "mamba",
            "--model.flavour",
            "tiny-mamba",
            "--train.compile",
            "true",
            "--train.compile_scope",
            "model",
        ],
    )
    mamba, _ = parallelize(
        build_model(mcfg.model),
        mcfg,
        ParallelDims.from_config(mcfg.parallel, world_size=1),
        torch.device("cpu"),
        torch.float32,
    )
    assert mamba.backbone._compiled_call_impl is not None  # Mamba: the backbone module is the compiled body
    assert all(getattr(b, "_compiled_call_impl", None) is None for b in model.blocks())
    # auto: the whole body in one process, per-block compile under data parallelism (no error)
    cfg.train.compile_scope = "auto"
    model, _ = parallelize(
        build_model(cfg.model),
        cfg,
        ParallelDims.from_config(cfg.parallel, world_size=1),
        torch.device("cpu"),
        torch.float32,
    )
    assert hasattr(model.forward_hidden, "_torchdynamo_orig_callable")


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp", "none"])
def test_auto_compile_scope_is_per_block_under_parallelism(strategy):
    from anytrain.parallel.compile import resolve_compile_scope

    assert resolve_compile_scope("auto", strategy) == "blocks"
    assert resolve_compile_scope("auto", "single") == "model"
    assert resolve_compile_scope("blocks", strategy) == "blocks"


def test_profiling_two_steps_keeps_the_losses_and_writes_the_summary(baseline, small_data, tmp_path):
    run = tmp_path / "prof"
    profiled = train(small_data, run, "--profile.steps", "2", "--profile.start_step", "1")
    np.testing.assert_allclose(profiled, baseline, rtol=0, atol=1e-6)
    summary = json.loads((run / "profile" / "rank0.json").read_text())
    assert summary["steps"] == [1, 2] and summary["top"] and summary["wall_ms"] > 0


def test_attention_backend_is_applied_before_the_model_is_built(small_data, tmp_path, monkeypatch):
    """train.attention_backend reaches hardware.set_attention_backend (it had been a config field nothing read)."""
    from anytrain import hardware
    from anytrain.train import build as build_module

    calls = []
    built = build_module.get_spec

    def spy_spec(arch):  # the spec whose build() makes the model records when it runs
        spec = built(arch)
        make = spec.build
        return dataclasses.replace(spec, build=lambda args: calls.append("build") or make(args))

    monkeypatch.setattr(hardware, "set_attention_backend", lambda name: calls.append(name) or [])
    monkeypatch.setattr(build_module, "get_spec", spy_spec)
    trainer = _cpu_trainer(small_data, tmp_path / "run", "--train.attention_backend", "cudnn")
    trainer.close()
    assert calls[:2] == ["cudnn", "build"]


def _cpu_trainer(small_data, run_dir, *overrides: str):
    """An in-process Trainer on the tiny recipe (debug model, seq 32, global batch 4, fp32, CPU, no eval, no final
    save), with ``overrides`` on top."""
    from pathlib import Path

    from anytrain.config import load_config
    from anytrain.train.trainer import Trainer

    recipe = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
    cfg = load_config(
        recipe,
        [
            "--model.flavour",
            "debug",
            "--data.path",
            str(small_data),
            "--data.seq_len",
            "32",
            "--train.global_batch",
            "4",
            "--train.eval_batches",
            "0",
            "--train.dtype",
            "fp32",
            "--checkpoint.save_final",
            "false",
            *overrides,
        ],
    )
    cfg.device = "cpu"
    return Trainer(cfg, run_dir=str(run_dir))


def test_gc_is_off_while_training_and_collected_every_interval(small_data, tmp_path, monkeypatch):
    import gc

    trainer = _cpu_trainer(
        small_data, tmp_path / "run", "--train.steps", "5", "--train.log_interval", "1", "--train.gc_interval", "2"
    )
    collected, enabled = [], []
    real_collect, real_step = gc.collect, trainer.train_step
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation) or real_collect(generation))
    monkeypatch.setattr(trainer, "train_step", lambda step: enabled.append(gc.isenabled()) or real_step(step))
    assert gc.isenabled()
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    assert enabled == [False] * 5 and gc.isenabled()  # off for every step, back on afterwards
    assert collected.count(1) == 3  # young generation: once at the start, then before steps 2 and 4 (0-based)
    assert len(summary["window_tokens_per_s"]) == 5  # one rate per log window, for the benches' spread


def test_gc_interval_must_not_be_negative():
    from anytrain.config import load_config
    from anytrain.errors import ConfigError

    with pytest.raises(ConfigError, match="train.gc_interval"):
        load_config(None, ["--train.gc_interval", "-1"])


def test_cuda_graphs_on_cpu_train_eagerly_and_say_so(small_data, tmp_path, capsys):
    """The same recipe with train.cuda_graphs runs on a CPU: eager micro-steps, a line saying why, no replays."""
    trainer = _cpu_trainer(
        small_data, tmp_path / "run", "--train.micro_batch", "2", "--train.steps", "3", "--train.cuda_graphs", "true"
    )
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    assert trainer.graphed is None and summary["cuda_graph_replays"] is None and summary["steps"] == 3
    assert "train.cuda_graphs: eager micro-steps (no graphs on cpu (GPU only))" in capsys.readouterr().err


@pytest.mark.parametrize(("arch", "casts", "accumulate"), [("mamba", True, False), ("transformer", False, True)])
def test_the_family_step_context_spans_the_micro_batches_and_closes_before_the_update(
    small_data, tmp_path, monkeypatch, arch, casts, accumulate
):
    """A one-process step's micro-batches run inside the model family's step context (``ParallelizePlan.
    step_context``), closed before the optimizer updates the weights: Mamba's ``mamba_inner.cached_weight_casts``
    (fused optimizers do not bump the version counters the cache also checks), the Transformer's
    ``wide_mm.accumulate_in_gemm`` (its GEMMs sum the later micro-batches' weight gradients into .grad)."""
    from anytrain.kernels import mamba_inner

    trainer = _cpu_trainer(
        small_data, tmp_path / "run", "--model.arch", arch, "--train.steps", "2", "--train.micro_batch", "2"
    )
    events = []
    real_fb, real_update = trainer.forward_backward, trainer.optimizer.step
    from anytrain.kernels import wide_mm

    def state():
        return mamba_inner._casts is not None, wide_mm._accumulate

    monkeypatch.setattr(
        trainer, "forward_backward", lambda *a, **k: events.append(("micro", *state())) or real_fb(*a, **k)
    )
    monkeypatch.setattr(
        trainer.optimizer, "step", lambda *a, **k: events.append(("update", *state())) or real_update(*a, **k)
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    assert events == [("micro", casts, accumulate), ("micro", casts, accumulate), ("update", False, False)] * 2
    assert mamba_inner._casts is None and not wide_mm._accumulate


def _params_after(trainer) -> dict:
    try:
        trainer.train()
    finally:
        trainer.close()
    return {k: v.detach().clone() for k, v in trainer.raw_model.state_dict().items()}


def test_bf16_micro_batches_accumulate_weight_gradients_in_the_gemm(small_data, tmp_path, monkeypatch):
    """A one-process bf16 (autocast) run with 2 micro-batches per step: from the second micro-batch on, the
    projections' weight gradients are summed into .grad by the GEMM, and the weights after 2 steps are those of the
    same run with the path turned off (kernels.gemm_accumulate false)."""
    from anytrain.kernels import wide_mm

    args = ("--train.steps", "2", "--train.micro_batch", "2", "--train.dtype", "bf16")
    before = wide_mm.accumulated
    on = _params_after(_cpu_trainer(small_data, tmp_path / "on", *args))
    # debug Transformer: 2 layers x 7 projections, 1 later micro-batch per step, 2 steps
    assert wide_mm.accumulated - before == 2 * 7 * 2
    monkeypatch.setattr(wide_mm, "_accumulate_on", wide_mm._accumulate_on)  # restored after the test
    off = _params_after(_cpu_trainer(small_data, tmp_path / "off", *args, "--kernels.gemm_accumulate", "false"))
    assert wide_mm.accumulated - before == 2 * 7 * 2
    assert on.keys() == off.keys() and all(torch.equal(on[k], off[k]) for k in on)


@pytest.mark.parametrize("lagged", ["true", "false"])
def test_clipping_factor_goes_to_the_fused_optimizer(small_data, tmp_path, monkeypatch, lagged):
    """With torch's fused AdamW, clipping computes the norm and hands 1 / factor to the optimizer (grad_scale, used
    for that step only) instead of scaling the gradients itself: the weights equal those of torch's
    clip_grad_norm_ (train.clip_in_optimizer false) to float rounding, and differ from an unclipped run."""
    args = (
        "--train.steps",
        "3",
        "--train.optimizer_impl",
        "fused",
        "--train.lagged_checks",
        lagged,
        "--train.grad_clip",
        "0.05",
    )
    calls, seen = [], []
    real_clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: calls.append(1) or real_clip(*a, **k))
    trainer = _cpu_trainer(small_data, tmp_path / "fold", *args)
    real_step = trainer.optimizer.step
    optimizer = trainer.optimizer
    monkeypatch.setattr(
        optimizer, "step", lambda *a, **k: seen.append(float(optimizer.grad_scale)) or real_step(*a, **k)
    )
    folded = _params_after(trainer)
    assert not calls and len(seen) == 3 and all(s > 1.0 for s in seen)  # clipping was active
    assert "grad_scale" not in trainer.optimizer.__dict__
    no_fold = ("--train.clip_in_optimizer", "false")
    torch_clip = _params_after(_cpu_trainer(small_data, tmp_path / "torch", *args, *no_fold))
    assert len(calls) == 3
    unclipped = _params_after(_cpu_trainer(small_data, tmp_path / "none", *args[:6], "--train.grad_clip", "0"))
    for k in folded:
        assert torch.allclose(folded[k], torch_clip[k], rtol=1e-5, atol=1e-7), k
    assert any(not torch.allclose(folded[k], unclipped[k], rtol=1e-3, atol=1e-5) for k in folded)
