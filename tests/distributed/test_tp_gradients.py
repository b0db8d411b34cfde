"""Tensor parallelism leaves the sequence-parallel norms' weight gradients Partial (each TP rank holds its tokens'
share). The trainer sums them in one all-reduce before clipping (``reduce_partial_gradients``): the reduced gradients
equal DTensor's own Partial -> Replicate redistribution, and a step issues a fixed handful of all-reduces, not four
per norm weight (the clipping norm and AdamW's ops each reduced every Partial gradient again). The test launches this
file as 2 gloo ranks (``torchrun_ranks``, TP 2); each rank writes what it saw."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

LAYERS = 3  # 2 * 3 + 1 = 7 norm weights


def _all_reduces(trainer, step: int) -> int:
    """All-reduces one training step issues (DTensor's functional ones and plain ``dist.all_reduce``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.train_step(step)
    names = ("_c10d_functional::all_reduce", "c10d::allreduce_")
    return sum(e.count for e in prof.key_averages() if e.key in names)


def _worker(config: Path, out: Path) -> None:
    import torch
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.placement_types import Partial

    from anytrain.config import load_config
    from anytrain.parallel.tensor_parallel import reduce_partial_gradients
    from anytrain.train.trainer import Trainer
    from tests.conftest import end_rank

    trainer = Trainer(load_config(config, ["--model.args.n_layers", str(LAYERS)]), run_dir=str(out / "run"))
    trainer.train_step(0)
    inputs, targets, _ = trainer.sources.train.rank_batch(1, trainer.layout.dp_rank, trainer.layout.dp_world)
    micro = trainer.layout.plan.micro_batch
    trainer.forward_backward(inputs[:micro], targets[:micro], sync=True, step=1)
    params = [p for p in trainer.model.parameters() if p.grad is not None]
    partial = {
        id(p): p.grad for p in params if any(isinstance(pl, Partial) for pl in getattr(p.grad, "placements", ()))
    }
    expected = {k: g.redistribute(placements=[Replicate()]).to_local().clone() for k, g in partial.items()}
    local_ids = {k: g.to_local().data_ptr() for k, g in partial.items()}
    issued = reduce_partial_gradients(params)
    reduced = {id(p): p.grad for p in params if id(p) in partial}
    result = {
        "partial": len(partial),
        "issued": issued,
        "equal": all(torch.equal(reduced[k].to_local(), expected[k]) for k in partial),
        "replicated": all(tuple(g.placements) == (Replicate(),) for g in reduced.values()),
        "same_storage": all(reduced[k].to_local().data_ptr() == local_ids[k] for k in partial),
        "nothing_left": reduce_partial_gradients(params) == 0,
    }
    trainer.zero_grad()
    result["step_all_reduces"] = _all_reduces(trainer, 2)
    trainer.close()
    end_rank(out, result)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, small_data) -> list[dict]:
    from tests.conftest import torchrun_ranks

    return torchrun_ranks(__file__, small_data, tmp_path_factory.mktemp("tp_grads"), 4, 8, parallel="tp: 2")


def test_partial_gradients_are_summed_once_into_the_same_tensors(ranks):
    for rank in ranks:
        assert rank["partial"] == 2 * LAYERS + 1  # the norm weights, nothing else
        assert rank["issued"] == 1 and rank["nothing_left"]
        assert rank["equal"] and rank["replicated"] and rank["same_storage"]


def test_a_step_does_not_reduce_each_norm_gradient_again(ranks):
    """One coalesced reduction, the clipping norm's, the loss and guard's: 4 x 7 + 1 = 29 before the change."""
    for rank in ranks:
        assert rank["step_all_reduces"] <= 4


if __name__ == "__main__":  # one rank (see ``ranks``)
    _worker(Path(sys.argv[1]), Path(sys.argv[2]))
