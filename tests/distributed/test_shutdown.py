"""A data-parallel trainer lets go of DDP's wrapper when it closes, before the process group is destroyed.

DDP's C++ Reducer holds a reference to the process group. After a NaN stop the error's traceback keeps the trainer
alive past ``destroy_process_group``; the Reducer then dropped the group's last reference while the traceback
unwound, with the GIL held, and gloo's destructor waited for a worker thread that itself waited for the GIL to free a
finished collective's tensors: one rank of a 2-rank test printed the stop and never exited (py-spy: the main thread
in ``~ProcessGroupGloo`` joining, a worker in ``~AsyncAllgatherWork`` acquiring the GIL). ``Trainer.close`` now
unwraps DDP, so the wrapper and its Reducer go while the group is registered and the group's last reference is
dropped by ``destroy_process_group`` (GIL released). The test launches this file as 2 ranks (``torchrun_ranks``); each
trains the debug Transformer for two steps under DDP and under ZeRO-1, closes the trainer while still holding it, and
records whether the wrapper is gone."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


def _wrapper_freed_on_close(config: Path, run_dir: Path, strategy: str) -> dict:
    import gc
    import weakref

    from anytrain.config import load_config
    from anytrain.train.trainer import Trainer

    trainer = Trainer(load_config(config, ["--parallel.strategy", strategy]), run_dir=str(run_dir))
    for step in range(2):
        trainer.train_step(step)
    wrapper = weakref.ref(trainer.model)
    wrapped = type(trainer.model).__name__
    trainer.close()  # the trainer object stays referenced, as by a traceback
    gc.collect()
    return {
        "wrapped": wrapped,
        "freed": wrapper() is None,
        "params": sum(1 for _ in trainer.model.parameters()),
        "state_is_module": trainer.state.model is trainer.model,
    }


def _worker(config: Path, out: Path) -> None:
    from tests.conftest import end_rank

    end_rank(out, {s: _wrapper_freed_on_close(config, out / s, s) for s in ("ddp", "zero1")})


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, small_data) -> list[dict]:
    from tests.conftest import torchrun_ranks

    return torchrun_ranks(__file__, small_data, tmp_path_factory.mktemp("shutdown"), 2, 4)


def test_close_releases_the_ddp_wrapper_before_the_group_is_destroyed(ranks):
    for rank in ranks:
        for strategy in ("ddp", "zero1"):
            run = rank[strategy]
            assert run["wrapped"] == "DistributedDataParallel"
            assert run["freed"], strategy  # nothing else in the trainer keeps the wrapper (and its Reducer)
            assert run["params"] > 0 and run["state_is_module"]  # the module itself stays, for reading weights


if __name__ == "__main__":  # one rank (see ``ranks``)
    _worker(Path(sys.argv[1]), Path(sys.argv[2]))
