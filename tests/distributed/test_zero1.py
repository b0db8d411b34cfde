"""ZeRO-1 (DDP's all-reduce, AdamW sharded across the ranks, the updated rows all-gathered) trains like DDP: the same
losses, and the same parameters on every rank after the steps. The test launches this file as 2 gloo ranks
(``torchrun_ranks``: torchrun's launch variables); each rank writes what it saw."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

STEPS = 4


def _losses(trainer) -> list[float]:
    from anytrain.parallel.collectives import all_reduce_mean

    out = []
    for step in range(STEPS):
        loss, _, _ = trainer.train_step(step)
        out.append(all_reduce_mean(loss).item())
    return out


def _worker(config: Path, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from anytrain.config import load_config
    from anytrain.train.trainer import Trainer
    from tests.conftest import end_rank

    ddp = Trainer(load_config(config, ["--parallel.strategy", "ddp"]), run_dir=str(out / "ddp"))
    ddp_losses = _losses(ddp)
    ddp.close()
    trainer = Trainer(load_config(config, ["--parallel.strategy", "zero1"]), run_dir=str(out / "zero1"))
    zero1_losses = _losses(trainer)
    flat = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    result = {
        "ddp": ddp_losses,
        "zero1": zero1_losses,
        "ranks_agree": all(torch.equal(gathered[0], g) for g in gathered),
    }
    trainer.close()
    end_rank(out, result)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, small_data) -> list[dict]:
    from tests.conftest import torchrun_ranks

    return torchrun_ranks(__file__, small_data, tmp_path_factory.mktemp("zero1"), STEPS, 8)


def test_parameters_agree_on_every_rank(ranks):
    assert all(rank["ranks_agree"] for rank in ranks)


def test_losses_equal_ddp(ranks):
    for rank in ranks:
        assert rank["zero1"][-1] < rank["zero1"][0]
        np.testing.assert_allclose(rank["zero1"], rank["ddp"], rtol=0, atol=1e-6)


if __name__ == "__main__":  # one rank (see ``ranks``)
    _worker(Path(sys.argv[1]), Path(sys.argv[2]))
