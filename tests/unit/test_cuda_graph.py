"""train.cuda_graphs pieces that run without a GPU: where capture applies, and the in-place gradient zeroing the
captured accumulation relies on (the replay itself: tests/gpu/test_cuda_graph_gpu.py)."""

import torch

from anytrain.train.cuda_graph import GraphedMicroStep, applicability


def test_applicability_names_why_a_run_stays_eager():
    gpu = torch.device("cuda", 0)
    assert applicability(gpu, 1, False, False) is None
    assert "GPU only" in applicability(torch.device("cpu"), 1, False, False)
    assert applicability(gpu, 2, False, False) is None  # tensor parallelism alone: its collectives are captured
    assert "data-parallel" in applicability(gpu, 2, False, False, data_parallel=True)
    assert "pipeline" in applicability(gpu, 1, True, False)
    assert "pipeline" in applicability(gpu, 4, True, False)
    assert "ANYTRAIN_TEST_NAN_AT_STEP" in applicability(gpu, 1, False, True)


def test_zero_grads_keeps_the_captured_tensors():
    """The graph writes to the gradient tensors it saw at capture: zeroing must keep them (in place) and put them back
    where other code dropped or replaced a parameter's .grad."""
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(1))]
    params[2].requires_grad_(False)
    step = GraphedMicroStep(lambda x, y: x.sum(), params)
    assert len(step.params) == 2  # frozen parameters get no gradient buffer
    step.zero_grads()  # before capture: nothing to keep
    for p in step.params:
        p.grad = torch.full_like(p, 5.0)
    step.grads = [p.grad for p in step.params]
    kept = list(step.grads)
    step.params[0].grad = None
    step.params[1].grad = torch.zeros(2)
    step.zero_grads()
    for p, g in zip(step.params, kept, strict=True):
        assert p.grad is g and torch.equal(g, torch.zeros_like(g))


def test_zero_grads_of_a_tensor_parallel_model_mixes_dtensors_and_plain_tensors():
    """Under tensor parallelism the gradients are DTensors (the sequence-parallel norms' ones Partial) and the LM
    head's is a plain tensor: one foreach call refuses the mix and DTensor refuses an in-place zero of a Partial, so
    the local tensors are zeroed (a 1-rank gloo group stands in for the TP mesh)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        params = [
            torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])),
            torch.nn.Parameter(distribute_tensor(torch.ones(3), mesh, [Replicate()])),
            torch.nn.Parameter(torch.ones(5)),
        ]
        step = GraphedMicroStep(lambda x, y: x.sum(), params)
        for p in params:
            p.grad = p.detach().clone() * 3
        partial = DTensor.from_local(torch.full((3,), 3.0), mesh, [Partial()])  # as a norm's gradient under SP
        params[1].grad = partial
        step.grads = [p.grad for p in params]
        kept = list(step.grads)
        step.zero_grads()
        for p, g in zip(params, kept, strict=True):
            local = g.to_local() if hasattr(g, "to_local") else g
            assert p.grad is g and not local.any()
    finally:
        dist.destroy_process_group()
