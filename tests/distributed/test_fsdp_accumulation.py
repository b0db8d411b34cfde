"""FSDP2 with ``parallel.reshard_during_accumulation: false`` on 2 gloo processes: same losses as the default, one
all-gather per FSDP module per step, parameters sharded again after every step and the configured resharding back.
With ``parallel.fsdp_group_blocks: 2`` as well, the debug model's two blocks are one FSDP unit: one all-gather for
them (plus the root's) per step, and the same losses.

The test launches this file as 2 ranks (``torchrun_ranks``); each rank trains the debug transformer twice (default,
then with the option off) in one process group and writes what it saw to ``<out>/rank<r>.json``."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

STEPS = 3
GRAD_ACCUM = 2  # global batch 8 over 2 ranks = 4 sequences each, in micro-batches of 2


def _sharded(model) -> list[bool]:
    """Per parameter: is the module's registered parameter FSDP's sharded DTensor (not the gathered tensor)?"""
    from torch.distributed.tensor import DTensor, Shard

    return [isinstance(p, DTensor) and all(isinstance(pl, Shard) for pl in p.placements) for p in model.parameters()]


def _train(config: Path, run_dir: Path, reshard_during_accumulation: bool, group_blocks: int = 1) -> dict:
    """STEPS optimizer steps; per micro-batch the all-gathers issued and whether all parameters were sharded after it;
    then which parameters a no-grad forward leaves gathered (the configured reshard_after_forward)."""
    import torch
    import torch.distributed as dist

    from anytrain.config import load_config
    from anytrain.parallel.collectives import all_reduce_mean
    from anytrain.train.trainer import Trainer

    flag = str(reshard_during_accumulation).lower()
    overrides = ["--parallel.reshard_during_accumulation", flag, "--parallel.fsdp_group_blocks", str(group_blocks)]
    trainer = Trainer(load_config(config, overrides), run_dir=str(run_dir))
    assert trainer.strategy == "fsdp" and trainer.layout.plan.grad_accum == GRAD_ACCUM
    gathers, micro_batches = [0], []
    all_gather_single, forward_backward = dist.all_gather_single, trainer.forward_backward

    def counting_all_gather(*args, **kwargs):  # FSDP2's default all-gather
        gathers[0] += 1
        return all_gather_single(*args, **kwargs)

    def recording_forward_backward(*args, **kwargs):
        out = forward_backward(*args, **kwargs)
        micro_batches.append({"sync": kwargs["sync"], "all_sharded": all(_sharded(trainer.model))})
        return out

    trainer.forward_backward = recording_forward_backward
    losses, grad_norms, gathers_per_step = [], [], []
    dist.all_gather_single = counting_all_gather
    try:
        for step in range(STEPS):
            gathers[0] = 0
            loss, grad_norm, _ = trainer.train_step(step)
            gathers_per_step.append(gathers[0])
            losses.append(all_reduce_mean(loss).item())
            grad_norms.append(grad_norm.item())
    finally:
        dist.all_gather_single = all_gather_single
    inputs, _, _ = trainer.sources.val.rank_batch(0, trainer.layout.dp_rank, trainer.layout.dp_world)
    with torch.no_grad():
        trainer.model(inputs[: trainer.layout.plan.micro_batch])
    after_eval_forward = _sharded(trainer.model)
    trainer.evaluator.evaluate()  # reshards what the forward kept
    trainer.close()
    fsdp_modules = sum(1 for m in trainer.model.modules() if hasattr(m, "set_reshard_after_backward"))
    n_blocks = len(trainer.model.blocks())
    return {
        "losses": losses,
        "grad_norms": grad_norms,
        "gathers_per_step": gathers_per_step,
        "micro_batches": micro_batches,
        "after_eval_forward": after_eval_forward,
        "fsdp_modules": fsdp_modules,
        "n_blocks": n_blocks,
    }


def _worker(config: Path, out: Path) -> None:
    from tests.conftest import end_rank

    cases = (("default", True, 1), ("gathered", False, 1), ("grouped", False, 2))
    end_rank(out, {name: _train(config, out / name, flag, group) for name, flag, group in cases})


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, small_data) -> list[dict]:
    from tests.conftest import torchrun_ranks

    return torchrun_ranks(__file__, small_data, tmp_path_factory.mktemp("fsdp_accum"), STEPS, 8, "strategy: fsdp")


def test_losses_match_the_default(ranks):
    for rank in ranks:
        default, gathered = rank["default"], rank["gathered"]
        assert default["losses"][-1] < default["losses"][0]  # it trains
        np.testing.assert_allclose(gathered["losses"], default["losses"], rtol=0, atol=1e-5)
        np.testing.assert_allclose(gathered["grad_norms"], default["grad_norms"], rtol=1e-4)


def test_one_all_gather_per_module_per_step(ranks):
    for rank in ranks:
        default, gathered = rank["default"], rank["gathered"]
        assert gathered["gathers_per_step"] == [gathered["fsdp_modules"]] * STEPS
        # default: every module in every micro-batch's forward, and again in backward (all but the last block)
        assert all(n >= GRAD_ACCUM * (2 * default["fsdp_modules"] - 2) for n in default["gathers_per_step"])


def test_parameters_sharded_after_each_step_and_resharding_restored(ranks):
    for rank in ranks:
        default, gathered = rank["default"], rank["gathered"]
        assert all(mb["all_sharded"] for mb in default["micro_batches"])
        assert len(gathered["micro_batches"]) == STEPS * GRAD_ACCUM
        for mb in gathered["micro_batches"]:
            assert mb["all_sharded"] == mb["sync"]  # gathered between micro-batches, sharded after the step
        # after the steps each module has its configured reshard_after_forward again: a no-grad forward keeps the
        # same parameters gathered (the last block's) as without the option
        assert gathered["after_eval_forward"] == default["after_eval_forward"]
        assert not all(default["after_eval_forward"]) and any(default["after_eval_forward"])


if __name__ == "__main__":  # one rank (see ``ranks``)
    _worker(Path(sys.argv[1]), Path(sys.argv[2]))


def test_grouped_blocks_gather_once_per_group_with_the_same_losses(ranks):
    for rank in ranks:
        default, grouped = rank["default"], rank["grouped"]
        assert grouped["n_blocks"] == 2
        assert grouped["gathers_per_step"] == [2] * STEPS  # the 2-block unit and the root
        np.testing.assert_allclose(grouped["losses"], default["losses"], rtol=0, atol=1e-5)
        for mb in grouped["micro_batches"]:
            assert mb["all_sharded"] == mb["sync"]
