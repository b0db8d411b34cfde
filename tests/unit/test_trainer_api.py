"""The public Trainer constructor: a trainer fed its own batches, with no run directory, writes nothing. The Trainer
composes its parts (no mixin bases), and train/ imports no kernels: a model family's kernel state comes through its
``ParallelizePlan.step_context``."""

import ast
import os
from pathlib import Path

import torch

from anytrain.config import RunConfig
from anytrain.train.trainer import Trainer


class FixedBatches:
    """Two global batches of random tokens, cycled: (inputs, targets, sample ids) of a data-parallel rank."""

    def __init__(self, vocab: int, global_batch: int, seq: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.bank = [torch.randint(0, vocab, (global_batch, seq + 1), generator=gen) for _ in range(2)]

    def rank_batch(self, step: int, dp_rank: int, dp_world: int):
        tokens = self.bank[step % 2]
        per_rank = tokens.shape[0] // dp_world
        tokens = tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        return tokens[:, :-1], tokens[:, 1:], torch.arange(per_rank)


def _config(steps: int) -> RunConfig:
    cfg = RunConfig()
    cfg.device = "cpu"
    cfg.model.flavour = "debug"
    cfg.data.seq_len = 32
    cfg.data.path = "/nonexistent/data"  # never opened: the batches come from the caller
    cfg.train.global_batch, cfg.train.steps, cfg.train.warmup_steps = 4, steps, 1
    cfg.train.lr, cfg.train.log_interval, cfg.train.eval_batches = 3e-3, 5, 2
    return cfg


def test_trainer_with_batches_and_no_run_dir_trains_and_writes_nothing(tmp_path):
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        trainer = Trainer(_config(steps=20), batches=FixedBatches(512, 4, 32))
        assert trainer.run_dir is None and trainer.checkpointer is None and trainer.sources.val is None
        first, _, _ = trainer.train_step(0)
        summary = trainer.train()
        trainer.close()
    finally:
        os.chdir(cwd)
    assert list(tmp_path.iterdir()) == []
    assert summary["run_dir"] is None and summary["steps"] == 20 and summary["checkpoint"] is None
    last, _, _ = trainer.train_step(20)  # the two batches it has seen 10 times each
    assert float(last) < 0.8 * float(first)


def test_rewind_restores_the_schedule_through_its_state_dict():
    trainer = Trainer(_config(steps=50), batches=FixedBatches(512, 4, 32))
    lrs = []
    for step in range(6):
        lrs.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.train_step(step)
        trainer.progress["step"] = step + 1
    trainer._rewind_to(2)
    assert trainer.progress["step"] == 2
    assert trainer.scheduler.last_epoch == 2
    assert trainer.scheduler.get_last_lr()[0] == lrs[2] == trainer.optimizer.param_groups[0]["lr"]
    trainer.close()


def test_trainer_composes_its_parts_and_train_imports_no_kernels():
    """No mixin bases; no module of anytrain.train imports anytrain.kernels at any level (function bodies and
    TYPE_CHECKING blocks included)."""
    assert Trainer.__bases__ == (object,)
    train = Path(__file__).resolve().parents[2] / "src" / "anytrain" / "train"
    found = []
    for path in sorted(train.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            found += [f"{path.name}: {name}" for name in names if name.split(".")[:2] == ["anytrain", "kernels"]]
    assert found == []


def test_the_family_step_context_wraps_the_micro_batches(monkeypatch):
    """``train_step`` runs every micro-batch inside the family's ``ParallelizePlan.step_context`` (entered once per
    optimizer step, with the model, the strategy and whether a CUDA graph replays) and leaves it before the update."""
    import contextlib

    cfg = _config(steps=4)
    cfg.train.micro_batch = 2  # two micro-batches per optimizer step
    trainer = Trainer(cfg, batches=FixedBatches(512, 4, 32))
    events = []

    @contextlib.contextmanager
    def context(model, strategy, graphed):
        events.append(("enter", model is trainer.model, strategy, graphed))
        yield
        events.append("exit")

    real_fb, real_update = trainer.forward_backward, trainer.optimizer.step
    monkeypatch.setattr(trainer.built, "family_step_context", context)
    monkeypatch.setattr(trainer, "forward_backward", lambda *a, **k: events.append("micro") or real_fb(*a, **k))
    monkeypatch.setattr(trainer.optimizer, "step", lambda *a, **k: events.append("update") or real_update(*a, **k))
    try:
        trainer.train_step(0)
    finally:
        trainer.close()
    assert events == [("enter", True, "single", False), "micro", "micro", "exit", "update"]


def test_a_failed_set_up_releases_the_run_lock_and_closes_the_log(tmp_path, monkeypatch):
    """A library caller whose Trainer fails after the run directory is set up (here: in the model build) goes on in
    the same process: the failure is recorded, the run directory's lock released and the log's files closed, so the
    next Trainer on that directory is not refused as a second writer."""
    import json

    import pytest

    import anytrain.train.trainer as trainer_module
    from anytrain.train.rundir import RunLock

    loggers = []

    class Logger(trainer_module.MetricsLogger):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            loggers.append(self)

    def broken_build(*args, **kwargs):
        raise RuntimeError("no model today")

    monkeypatch.setattr(trainer_module, "MetricsLogger", Logger)
    monkeypatch.setattr(trainer_module, "build_model", broken_build)
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="no model today"):
        Trainer(_config(steps=2), batches=FixedBatches(512, 4, 32), run_dir=str(run))
    assert json.loads((run / "status.json").read_text())["state"] == "failed"
    assert loggers[0]._jsonl.closed
    lock = RunLock(run)
    lock.acquire()  # RunDirError ("... is in use by ...") while the failed Trainer still holds it
    lock.release()
    monkeypatch.undo()
    trainer = Trainer(_config(steps=2), batches=FixedBatches(512, 4, 32), run_dir=str(run), resume=True)
    try:
        trainer.train()
    finally:
        trainer.close()
    status = json.loads((run / "status.json").read_text())
    assert (status["state"], status["step"]) == ("finished", 2)
