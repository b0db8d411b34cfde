"""The Transformer's SequenceShardedLoss (parallel.tp_sequence_loss) on a one-process gloo group: a rank's share
of the micro-batch loss is its positions' summed token losses over the micro-batch's valid targets, a shard without
a valid target adds 0 with finite zero gradients, and ``gather`` returns the whole sequence (the multi-rank parity
runs are in tests/distributed)."""

import pytest
import torch
import torch.distributed as dist

from anytrain.models.llama.parallelize import SequenceShardedLoss
from anytrain.models.losses import lm_cross_entropy


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_rank_shares_sum_to_the_micro_batch_loss_and_an_ignored_shard_adds_zero(group):
    torch.manual_seed(0)
    hidden = torch.randn(2, 8, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(32, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 32, (2, 8))
    targets[:, 5] = -100  # an ignored position: the count of valid targets is not the number of positions
    full = lm_cross_entropy(hidden, weight, targets)
    shares = [SequenceShardedLoss(group, r, 2)(hidden[:, 4 * r : 4 * r + 4], weight, targets) for r in range(2)]
    torch.testing.assert_close(shares[0] + shares[1], full)  # a world of one: each share is its rank's alone
    targets[:, 4:] = -100  # rank 1's shard holds no valid target
    first = SequenceShardedLoss(group, 0, 2)(hidden[:, :4], weight, targets)
    torch.testing.assert_close(first, lm_cross_entropy(hidden[:, :4], weight, targets[:, :4]))
    empty = SequenceShardedLoss(group, 1, 2)(hidden[:, 4:], weight, targets)
    assert empty.item() == 0.0
    grads = torch.autograd.grad(empty, [hidden, weight])
    assert all(torch.isfinite(g).all() and not g.any() for g in grads)


def test_gather_returns_the_whole_sequence_and_a_misaligned_shard_is_one_line(group):
    from torch.distributed.device_mesh import init_device_mesh

    loss = SequenceShardedLoss(group, 0, 1, init_device_mesh("cpu", (1,)))
    hidden = torch.randn(2, 6, 4, requires_grad=True)
    full = loss.gather(hidden)
    torch.testing.assert_close(full, hidden)
    (full * 3).sum().backward()  # differentiable: a loss computed from gathered logits trains the body
    torch.testing.assert_close(hidden.grad, torch.full_like(hidden, 3.0))
    with pytest.raises(ValueError, match="parallel.tp_sequence_loss: hidden shard of 3 positions against 6 targets"):
        loss(hidden[:, :3], torch.randn(5, 4), torch.zeros(2, 6, dtype=torch.long))
