"""``train.cuda_graphs``: each micro-batch's forward and backward replayed from one captured CUDA (or HIP) graph.

Small models are host-bound: a mamba-130m micro-batch is ~1,000 kernel launches (autocast weight casts, the fused
mixer's Triton kernels, gradient accumulation adds), and the host needs longer to issue them than the GPU needs to
run them (measured: docs/history/kernel-and-benchmark-log.md). With this option the whole micro-step --
autocast forward, the loss, ``backward`` with every gradient accumulated in place into its ``.grad`` -- is captured
once, on the first micro-batch of the first step, and replayed for every micro-batch after that: the host only copies
the micro-batch's token ids into the graph's static input buffers and launches the graph.

Capture follows torch.cuda.graph's "whole network capture" recipe: a few warm-up micro-steps on a side stream first
(per-block ``torch.compile`` compiles there, the allocator settles), then the capture; the gradients the warm-up left
are zeroed before the real step starts. The gradients the warm-up created are kept for the run (the captured
accumulation writes to those addresses): ``zero_grads`` zeroes them in place and re-attaches any that other code set
to None. Clipping and the (fused) optimizer step run eagerly on those same tensors; parameters are updated in place,
so the graph always reads the current weights. Memory: gradients stay allocated between steps, and the graph's
activations keep their private pool, which evaluation and the optimizer cannot reuse.

Applies only where it is sound (``applicability``): a GPU device, one process or a tensor-parallel-only run, and no loss
fault-injection hook (the loss hook depends on the step number). Data parallelism (DDP's and FSDP's hooks run host logic
per bucket and unit) and pipeline schedules are not captured. A tensor-parallel run's collectives (DTensor's, in the
compiled blocks and around the embedding and the final norm) are functional collectives: a launch on the communicator's
stream and a stream wait, no host work, so they are captured with the step on every TP rank; its DTensor gradients
accumulate in place as plain ones do (checked on CPU). The capture runs in thread-local mode, so that the communicator's
watchdog thread may keep querying its events meanwhile (tests/gpu/test_tp_cuda_graph_gpu.py, 2 GPUs: not run yet).
Elsewhere the trainer runs its eager micro-step and says why once. The captured code must not synchronise with the host
or change shapes between micro-batches; anytrain's models and kernels do neither (tests/gpu/test_cuda_graph_gpu.py
checks graph and eager losses and weights step by step).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from anytrain import hardware


def applicability(
    device: torch.device, world_size: int, pipeline: bool, fault_hook: bool, data_parallel: bool = False
) -> str | None:
    """None when the micro-step can be captured, else the reason it runs eagerly. ``world_size`` > 1 without data
    parallelism or a pipeline is a tensor-parallel-only run: captured."""
    if not hardware.is_gpu(device):
        return f"no graphs on {device.type} (GPU only)"
    if pipeline or (world_size > 1 and data_parallel):
        return "data-parallel and pipeline runs are not captured (DDP/FSDP hooks, pipeline schedules)"
    if fault_hook:
        return "a loss fault-injection hook (ANYTRAIN_TEST_NAN_AT_STEP) is set"
    return None


class GraphedMicroStep:
    """``step(inputs, targets) -> loss``: ``micro_step`` (forward + backward of one micro-batch, returning the
    detached loss) captured on its first call and replayed afterwards. ``inputs``/``targets`` must keep their shape
    and dtype; they are copied into the graph's static buffers before each replay."""

    def __init__(
        self,
        micro_step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        params: list[torch.nn.Parameter],
        warmup: int = 3,
        distributed: bool = False,
    ) -> None:
        self.micro_step = micro_step
        self.capture_error_mode = "thread_local" if distributed else "global"  # NCCL's watchdog queries events
        self.params = [p for p in params if p.requires_grad]
        self.warmup = warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        self.grads: list[torch.Tensor] = []
        self.static: tuple[torch.Tensor, torch.Tensor] | None = None
        self.loss: torch.Tensor | None = None
        self.replays = 0
        self._zero_targets: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # (grads, what zeroes them)

    def _capture(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.static = (inputs.clone(), targets.clone())
        side = torch.cuda.Stream(device=inputs.device)
        side.wait_stream(torch.cuda.current_stream(inputs.device))
        with torch.cuda.stream(side):
            for _ in range(max(1, self.warmup)):
                self.micro_step(*self.static)
        torch.cuda.current_stream(inputs.device).wait_stream(side)
        # the warm-up's freed activations stay cached in the default pool, which the graph's private pool cannot
        # use: return them, or the capture needs a second copy of the activations (TP2 at micro-batch 16 ran out)
        torch.cuda.synchronize(inputs.device)
        torch.cuda.empty_cache()
        # The accumulation targets, kept for the whole run (the graph writes to them): the gradients the warm-up
        # created. A parameter the step never reaches keeps .grad None, as in eager (no decay/moment update for it).
        self.params = [p for p in self.params if p.grad is not None]
        self.grads = [p.grad for p in self.params]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode=self.capture_error_mode):
            self.loss = self.micro_step(*self.static)
        self.graph = graph
        self.zero_grads()  # the warm-up's gradients (the capture itself ran nothing)

    def zero_grads(self) -> None:
        """Zero the captured gradient tensors in place, re-attaching any that were set to None or replaced."""
        if not self.grads:
            return
        for p, g in zip(self.params, self.grads, strict=True):
            if p.grad is not g:
                p.grad = g
        # a DTensor gradient (tensor parallelism) is zeroed through its local tensor: one foreach call takes them
        # together with plain ones (TP's LM head), and DTensor refuses an in-place zero of a Partial placement (the
        # sequence-parallel norms' gradients). The local views are made once per gradient list, not every step.
        if self._zero_targets is None or self._zero_targets[0] is not self.grads:
            with torch.no_grad():
                local = [g.to_local() if hasattr(g, "to_local") else g for g in self.grads]
            self._zero_targets = (self.grads, local)
        torch._foreach_zero_(self._zero_targets[1])

    def release(self) -> None:
        """Destroy the captured graph (after its last replay finished). A graph that captured NCCL collectives holds
        the communicator: destroying the process group first waits for the graph forever (tensor-parallel runs)."""
        if self.graph is not None:
            torch.cuda.synchronize(self.static[0].device)
            self.graph.reset()
            self.graph = None

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Replay for one micro-batch. The returned loss is the graph's own output buffer, overwritten by the next
        replay: read or add it before calling again (the trainer adds it into the step's loss right away)."""
        if self.graph is None:
            self._capture(inputs, targets)
        elif inputs.shape != self.static[0].shape or targets.shape != self.static[1].shape:
            raise ValueError(
                f"train.cuda_graphs: micro-batch shape {tuple(inputs.shape)} differs from the captured "
                f"{tuple(self.static[0].shape)}; graphs need a fixed micro-batch and seq_len"
            )
        self.static[0].copy_(inputs, non_blocking=True)
        self.static[1].copy_(targets, non_blocking=True)
        self.graph.replay()
        self.replays += 1
        return self.loss
