"""The public Trainer constructor: a trainer fed its own batches, with no run directory, writes nothing."""

import os

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
        assert trainer.run_dir is None and trainer.checkpointer is None and trainer.val_source is None
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
