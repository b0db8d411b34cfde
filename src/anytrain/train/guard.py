"""Per-step decisions every rank must take together: non-finite stop, preemption, timed checkpoint, spike skip.

One small all-reduce per step carries every rank's flags, so a NaN on one rank, a SIGTERM delivered to one rank, or
rank 0's wall clock saying "checkpoint now" reach every rank at the same step.

Synchronous (``check``): the step's one host sync (``.tolist()``) reads the reduced flags before the optimizer step;
it is skipped entirely for a single process with the finite check and spike guard off. Every multi-GPU step then
waits for the device, and the host's work for the next step (optimizer launch, data, FSDP hooks) is exposed: about
5 points of 2-GPU weak-scaling efficiency on the 1.1B Transformer (docs/scaling.md).

Lagged (``launch`` / ``resolve``, train.lagged_checks): the reduced flags are copied to the host asynchronously and
read one step later (or at the next log, eval or checkpoint, which synchronise anyway). The non-finite verdict
still acts before the bad update: ``launch`` returns it as a device tensor that the fused optimizer takes as
``found_inf`` and skips its update on, so the state after a bad step is the state before it.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from anytrain import hardware
from anytrain.config import RunConfig
from anytrain.errors import AnytrainError

EXIT_CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}


class Preempted(AnytrainError):
    """Training stopped on SIGTERM/SIGINT after saving a checkpoint; exit 143 / 130 like a killed process. Not an
    error: the CLI prints it as ``stopped: ...``."""

    clean_stop = True

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class StepStatus:
    nonfinite: bool = False
    stop: bool = False
    checkpoint_due: bool = False
    skip: bool = False
    loss: float | None = None  # global mean loss of the step, when it was synchronised
    step: int | None = None  # the 0-based step the flags belong to (lagged: the step before the one that read them)
    grad_norm: float | None = None  # lagged: that step's global gradient norm (for the non-finite message)


class StepGuard:
    def __init__(
        self, cfg: RunConfig, device: torch.device, is_main: bool, world_size: int, loss_ranks: int | None = None
    ) -> None:
        self.cfg, self.device, self.is_main, self.world_size = cfg, device, is_main, world_size
        self.loss_ranks = loss_ranks or world_size  # ranks holding a loss (pipeline: the last stage's)
        self.signal: int | None = None
        self._previous: dict[int, object] = {}
        self._last_save = time.monotonic()
        self._loss_mean: float | None = None
        self._loss_count = 0
        self.skipped_steps = 0
        self.lagged = False  # set by the trainer when train.lagged_checks applies (fused optimizer, no spike guard)
        self._pending: tuple | None = None  # lagged: (step, host copy of the reduced flags, its event)
        self.test_nan_step = int(os.environ.get("ANYTRAIN_TEST_NAN_AT_STEP", "0"))  # test hook: poison a step
        self.test_nan_rank = int(os.environ.get("ANYTRAIN_TEST_NAN_RANK", "0"))
        self.test_kill_step = int(os.environ.get("ANYTRAIN_TEST_KILL_AT_STEP", "0"))  # test hook: SIGKILL a rank
        self.test_kill_rank = int(os.environ.get("ANYTRAIN_TEST_KILL_RANK", "0"))

    # signals ---------------------------------------------------------------------------------------------------------

    def install(self) -> None:
        """Catch SIGTERM / SIGINT: the loop finishes the current step, checkpoints, and exits 143 / 130 (a signal
        that comes before the first step stops the run there). Installing twice keeps the first installation."""
        if self._previous:
            return
        for sig in EXIT_CODES:
            try:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread (e.g. embedded use): leave default handling
                pass

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
        if self.signal is not None and signum == signal.SIGINT:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.signal = signum

    def signal_reached_any_rank(self) -> bool:
        """Whether some rank has caught a signal: one all-reduce (with several ranks), for decisions outside the step
        loop, where the per-step agreement does not run. Every rank must call it at the same point."""
        if self.world_size == 1:
            return self.signal is not None
        flag = torch.tensor([float(self.signal is not None)], device=self.device)
        dist.all_reduce(flag)
        return bool(flag.item() > 0)

    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signal, 143)

    def signal_name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else "SIGTERM"

    # timed checkpoints ----------------------------------------------------------------------------------------------

    def _time_due(self) -> bool:
        minutes = self.cfg.checkpoint.interval_minutes
        return bool(self.is_main and minutes and time.monotonic() - self._last_save >= 60 * minutes)

    def saved(self) -> None:
        self._last_save = time.monotonic()

    # the per-step agreement -----------------------------------------------------------------------------------------

    def _reduced_flags(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """[non-finite, signal, checkpoint due, loss, gradient norm] summed over the ranks, on the device; no host
        sync (the host flags travel through pinned memory on GPUs)."""
        gpu = hardware.is_gpu(self.device)
        host = torch.tensor([float(self.signal is not None), float(self._time_due())])
        host = host.pin_memory().to(self.device, non_blocking=True) if gpu else host.to(self.device)
        grad_norm = grad_norm.detach().float().reshape(1)
        if self.cfg.train.check_finite:
            nonfinite = (~torch.isfinite(grad_norm)).float()
        else:
            nonfinite = torch.zeros(1, device=self.device)
        norm = grad_norm / self.world_size  # the same on every rank: sums to itself
        vec = torch.cat([nonfinite, host, loss.detach().float().reshape(1), norm])
        if self.world_size > 1:
            dist.all_reduce(vec)
        return vec

    def _status(self, values: list[float], step: int) -> StepStatus:
        nonfinite_count, stop_count, due_count, loss_sum, norm = values
        return StepStatus(
            nonfinite_count > 0,
            stop_count > 0,
            due_count > 0,
            loss=loss_sum / self.loss_ranks,
            step=step,
            grad_norm=norm,
        )

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> StepStatus:
        """Flags for step ``step`` (0-based), agreed by all ranks. ``loss`` is this rank's step loss (device)."""
        train = self.cfg.train
        if not (train.check_finite or train.spike_factor or self.world_size > 1):
            return StepStatus(stop=self.signal is not None, checkpoint_due=self._time_due(), step=step)
        status = self._status(self._reduced_flags(loss, grad_norm).tolist(), step)
        status.skip = not status.nonfinite and self._is_spike(status.loss)
        return status

    def uses_lag(self) -> bool:
        """Whether ``launch`` / ``resolve`` apply: lagged checks on, and something to agree on."""
        return self.lagged and (self.cfg.train.check_finite or self.world_size > 1)

    def launch(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """Lagged agreement of step ``step``: reduce the flags on the device and start their copy to the host, with
        no host sync. Returns found_inf, a 0-dim float32 device tensor that is 1 when some rank's gradient norm is
        not finite, for the fused optimizer to skip the update on."""
        gpu = hardware.is_gpu(self.device)
        vec = self._reduced_flags(loss, grad_norm)
        out = torch.empty(vec.shape, dtype=vec.dtype, pin_memory=gpu)
        out.copy_(vec, non_blocking=gpu)
        event = None
        if gpu:
            event = torch.Event(device=self.device)
            event.record()
        self._pending = (step, out, event)
        return (vec[0] > 0).float()

    def resolve(self) -> StepStatus | None:
        """The agreed flags of the launched step (None when none is pending). Waits only for that step's copy, which
        the device has finished by the time the next step's work is queued."""
        if self._pending is None:
            return None
        step, out, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        return self._status(out.tolist(), step)

    def spike_state(self) -> list:
        """The spike guard's running state (saved in checkpoints: a resumed run skips the same steps)."""
        return [self._loss_mean, self._loss_count, self.skipped_steps]

    def load_spike_state(self, state: list) -> None:
        self._loss_mean, self._loss_count, self.skipped_steps = state

    def _is_spike(self, loss: float) -> bool:
        """Loss above spike_factor × the running mean of accepted losses (after 10 accepted steps)."""
        factor = self.cfg.train.spike_factor
        if factor and self._loss_count >= 10 and loss > factor * self._loss_mean:
            self.skipped_steps += 1
            return True
        self._loss_count += 1
        beta = 0.9 if self._loss_count > 10 else 1.0 - 1.0 / self._loss_count
        self._loss_mean = loss if self._loss_mean is None else beta * self._loss_mean + (1 - beta) * loss
        return False

    # test hooks -----------------------------------------------------------------------------------------------------

    def poison(self, step: int, rank: int, loss: torch.Tensor) -> torch.Tensor:
        """Test hook: make this rank's loss NaN at 1-based step ANYTRAIN_TEST_NAN_AT_STEP."""
        if self.test_nan_step and step + 1 == self.test_nan_step and rank == self.test_nan_rank:
            return loss * float("nan")
        return loss

    def maybe_kill(self, step: int, rank: int) -> None:
        """Test hook: SIGKILL this rank when 1-based step ANYTRAIN_TEST_KILL_AT_STEP starts (a hard crash)."""
        if self.test_kill_step and step + 1 == self.test_kill_step and rank == self.test_kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
