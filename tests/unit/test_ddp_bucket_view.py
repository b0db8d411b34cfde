"""parallel.ddp_bucket_view: DDP is built with gradient_as_bucket_view, so the gradients are views of its buckets
(the 2-rank gloo runs with it give the single-process losses: tests/distributed/test_data_parallel.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from anytrain.config import ParallelConfig, TrainConfig
from anytrain.parallel.data_parallel import apply_ddp
from anytrain.parallel.mesh import ParallelDims


@pytest.mark.parametrize("views", [True, False])
def test_ddp_gradients_are_bucket_views_only_when_asked(views):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        parallel = ParallelConfig(strategy="ddp", ddp_bucket_view=views)
        model = apply_ddp(module, ParallelDims.from_config(parallel, 1), torch.device("cpu"), parallel, TrainConfig())
        assert model.gradient_as_bucket_view is views
        model(torch.randn(4, 8)).sum().backward()
        grads = [p.grad for p in module.parameters()]
        storages = {g.untyped_storage().data_ptr() for g in grads}
        assert (len(storages) == 1) is views  # views share the one bucket's storage; plain grads are apart
    finally:
        dist.destroy_process_group()
