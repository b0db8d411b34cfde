"""The training loop: one process per device, same code for 1 process, DDP and FSDP, CPU and GPU.

Host/device synchronisation happens only on log and eval steps, and once per step for the finite check
(``train.check_finite``, which reads the global gradient norm so every rank takes the same decision).

``Trainer`` runs the step, the loop, logging and checkpoint / stop handling with the parts it holds: ``layout`` and
``built`` (train/build.py: rank, device and batch plan; the model as trained, its optimizer, LR schedule, autocast
and the model family's step context, ``ParallelizePlan.step_context``), ``sources``, ``evaluator``
(train/evaluation.py), ``guard`` (train/guard.py: the per-step agreement of all ranks), ``state`` and
``checkpointer`` (checkpoint/dcp.py), ``log`` and ``meter`` (train/metrics.py) and ``graphed`` (the captured
CUDA-graph micro-step, or None).
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import torch
from torch import nn

from anytrain import hardware
from anytrain.checkpoint.dcp import Checkpointer, TrainState
from anytrain.config import RunConfig, to_dict
from anytrain.data.loader import BatchProvider
from anytrain.data.resolve import resolve_run_config
from anytrain.data.shards import TokenDataset
from anytrain.errors import ConfigError, RunDirError, TrainingError
from anytrain.parallel.collectives import barrier, gather_object
from anytrain.parallel.data_parallel import gradient_sync
from anytrain.train import rundir
from anytrain.train.build import (
    build_model,
    check_data_fits_model,
    clip_in_optimizer,
    lagged_checks_apply,
    log_model_size,
    open_sources,
    setup_cuda_graphs,
    setup_document_mask,
    setup_layout,
)
from anytrain.train.energy import EnergyMeter
from anytrain.train.evaluation import Evaluator
from anytrain.train.guard import Preempted, StepGuard, StepStatus
from anytrain.train.metrics import MetricsLogger, MetricWindow, RunMeter, global_mean
from anytrain.train.optim import GradClipper, optimizer_step, rewind_scheduler
from anytrain.train.profiling import StepProfiler, format_summary
from anytrain.train.wandb_sink import require_wandb


class Trainer:
    """One process's share of a training run.

    ``Trainer(cfg)`` is what ``anytrain train`` runs: data from ``cfg.data``, outputs in a run directory (``run_dir``,
    default ``runs/<name>-<time>``), ``resume`` / ``overwrite`` / ``resume_allow`` as the CLI flags. ``batches``
    replaces the prepared dataset with any source of ``rank_batch(step, dp_rank, dp_world) -> (inputs, targets,
    sample ids)`` (no validation split then); with ``batches`` and no ``run_dir`` the trainer writes nothing at all (no
    run directory, metrics or checkpoints): benchmarks and tests drive ``train_step`` or ``train`` that way.
    """

    def __init__(
        self,
        cfg: RunConfig,
        batches: BatchProvider | None = None,
        run_dir: str | None = None,
        resume: bool = False,
        overwrite: bool = False,
        resume_allow: tuple[str, ...] = (),
    ) -> None:
        self._started = time.perf_counter()  # the invocation's wall time counts from here (summary.json: wall_s)
        self._resume_record: dict | None = None  # metrics.jsonl's resume marker, written when training starts
        self._run: rundir.RunDir | None = None  # the run directory (rank 0 holds its lock); None: nothing written
        self.guard: StepGuard | None = None
        self.progress: dict = {"step": 0, "tokens_seen": 0}
        self.window: MetricWindow | None = None  # the log window while training (train())
        self._step = 0  # the step being run (the pipeline schedule's loss function reads it)
        self._end_step = cfg.train.steps  # this invocation's last step (train())
        try:
            self._setup(cfg, batches, run_dir, resume, overwrite, resume_allow)
        except BaseException as exc:
            if self.guard is not None:
                self.guard.uninstall()
            self._record_failure(exc)
            self._release_after_failed_setup()
            raise

    def _release_after_failed_setup(self) -> None:
        """What a set-up that raised had opened: the log's files and the run directory's lock (released last, after
        status.json recorded the failure). A library caller's process goes on and may start the run again."""
        log = getattr(self, "log", None)
        if log is not None:
            log.close()
        if self._run is not None and self._run.lock is not None:
            self._run.lock.release()

    def _setup(
        self,
        cfg: RunConfig,
        batches: BatchProvider | None,
        run_dir: str | None,
        resume: bool,
        overwrite: bool,
        resume_allow: tuple[str, ...],
    ) -> None:
        """The layout, the run directory and the log, the model (``_setup_state``) and the step (``_setup_step``)."""
        self.cfg = resolve_run_config(cfg)  # the model's and the prepared data's checks, before anything is written
        require_wandb(cfg.metrics.wandb)  # metrics.wandb without the package: one line, before anything is written
        self.layout = layout = setup_layout(cfg)
        info, device = layout.info, layout.device
        if cfg.profile.memory_snapshot and not hardware.is_gpu(device):  # before anything is written
            raise ConfigError(
                f"profile.memory_snapshot: the allocator's history exists on CUDA/ROCm GPUs only, and this run is on "
                f"{device.type}; set --profile.memory_snapshot false"
            )
        self.guard = StepGuard(cfg, device, info.is_main, info.world_size)
        if batches is None or run_dir is not None:  # a run: a SIGTERM from here on is a clean stop (train())
            self.guard.install()
        dataset = None if batches is not None else TokenDataset(cfg.data.path)
        if dataset is not None:
            check_data_fits_model(dataset, layout.model_args, cfg.data.seq_len)
        resume = resume or cfg.checkpoint.auto_resume
        if batches is None or run_dir is not None:  # marker, lock, config.yaml and status.json: train/rundir.py
            self._run = rundir.setup_run_dir(cfg, run_dir, resume, overwrite, resume_allow, info.is_main)
        self.run_dir = self._run.path if self._run is not None else None
        self.log = MetricsLogger(self.run_dir, info.is_main, cfg.train.steps, run_config=cfg)
        if not hardware.is_gpu(device):
            self.log.memory_label = "rss"  # peak_mem_gib on CPU: the process's peak resident set (RunMeter)
        if layout.auto_reason:
            self.log.print(f"parallel.auto: {layout.auto_reason}")
        self.built = build_model(cfg, layout, self.log.print, self._pipeline_loss)
        setup_document_mask(cfg, self.built.raw_model, dataset, batches)
        self._setup_state(resume)
        self.sources = open_sources(cfg, dataset, batches, layout.plan.global_batch)
        self.evaluator = Evaluator(cfg.train, layout, self.built, self.sources, self.log)
        self._setup_step()

    def _setup_state(self, resume: bool) -> None:
        """What a checkpoint holds (``TrainState``), the checkpointer of a run directory, and the resume."""
        cfg = self.cfg.checkpoint
        extras = self.built.grad_comm.checkpoint_state(self.progress, self.log.print)
        self.state = TrainState(self.model, self.optimizer, self.scheduler, self.progress, extras=extras)
        self.checkpointer = None
        if self.run_dir is None:
            return
        directory, is_main = self.run_dir / "checkpoints", self.layout.info.is_main
        self.checkpointer = Checkpointer(directory, cfg.keep_last, is_main, log=self.log.print, checksums=cfg.checksums)
        if resume:
            self._resume()

    def _setup_step(self) -> None:
        """The meter (FLOPs per token, device peak, power), the size line, the guard's and clipping's choices, the
        CUDA graph and the sample-id log."""
        cfg, layout, built = self.cfg, self.layout, self.built
        info, device = layout.info, layout.device
        self.tokens_per_step = layout.plan.global_batch * cfg.data.seq_len
        flops_per_token = built.accounting_model.flops_per_token(cfg.data.seq_len)
        # Power of this rank's device (NVML / AMD SMI); rank 0 scales it to the job. Absent on CPU: values are null.
        energy = EnergyMeter(device.index or 0) if hardware.is_gpu(device) else None
        peak_flops = hardware.peak_flops(device, cfg.train.peak_tflops or None)
        self.meter = RunMeter(device, info.world_size, flops_per_token, peak_flops, energy)
        log_model_size(cfg, layout, built, flops_per_token, self.log.print)
        self.guard.loss_ranks = built.loss_ranks
        self.guard.lagged = lagged_checks_apply(cfg, built.optimizer)
        # whether clipping hands its factor to the fused AdamW, decided once
        folds = cfg.train.clip_in_optimizer and clip_in_optimizer(built.optimizer, built.strategy, layout.dims)
        pp_group = built.pipeline.group if built.pipeline is not None else None
        self.clipper = GradClipper(cfg.train.grad_clip, folds, layout.dims.tp, device, pp_group)
        micro_step = lambda x, y: self.forward_backward(x, y, sync=True)  # what a CUDA graph captures
        fault_hook = bool(self.guard.test_nan_step)
        self.graphed = setup_cuda_graphs(cfg, layout, built, fault_hook, micro_step, self.log.print)
        self._sample_log = None  # train.log_sample_ids: the sample ids this rank trained on
        if cfg.train.log_sample_ids and self.run_dir is not None:
            self._sample_log = rundir.open_sample_log(self.run_dir, info.rank, self.progress["step"])

    def _resume(self) -> None:
        for change in self._run.changes:
            self.log.print(f"resume: changed {change}")
        try:
            latest = self.checkpointer.load_newest(self.state, set_aside=True)
        except RunDirError:
            if self.layout.info.is_main:
                self._run.restore_config()
            raise
        if latest is None:
            self.log.print(f"no committed checkpoint in {self.checkpointer.dir}: starting from step 0")
        else:
            self.log.print(f"resumed from {latest} (step {self.progress['step']})")
        # the marker that makes readers drop the records logged after this step by the previous invocation
        self._resume_record = {"step": self.progress["step"], "checkpoint": str(latest) if latest else None}

    # ----------------------------------------------------------------------------------------------------------------
    # the built model's parts, by name

    @property
    def model(self) -> nn.Module:
        """The model as trained (``BuiltModel.model``)."""
        return self.built.model

    @property
    def raw_model(self) -> nn.Module:
        """The single-device module before wrapping (``BuiltModel.raw_model``)."""
        return self.built.raw_model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.built.optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        return self.built.scheduler

    @property
    def strategy(self) -> str:
        """'single' | 'ddp' | 'zero1' | 'fsdp' | 'none' (``parallel.data_parallel.resolve_strategy``)."""
        return self.built.strategy

    # ----------------------------------------------------------------------------------------------------------------
    # steps

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, sync: bool, step: int = 0) -> torch.Tensor:
        """One micro-batch: (b, T) ids -> mean token loss / grad_accum, gradients accumulated. Returns the loss.
        ``train_step`` runs it inside the model family's step context (``BuiltModel.step_context``)."""
        built, grad_accum = self.built, self.layout.plan.grad_accum
        keep_gathered = grad_accum > 1 and not self.cfg.parallel.reshard_during_accumulation
        with gradient_sync(built.model, built.strategy, sync, keep_gathered=keep_gathered):
            with built.autocast():
                loss = built.model(inputs, targets) / grad_accum  # mean token loss of the micro-batch
            loss = self.guard.poison(step, self.layout.info.rank, loss)
            loss.backward()
        return loss.detach()

    def train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor, StepStatus]:
        """Optimizer step ``step`` (0-based) on this rank's slice of global batch ``step``.

        The optimizer step is skipped (and the caller stops) when the agreed status says the gradients are not
        finite; it is skipped and counted when the spike guard fires.
        """
        self.guard.maybe_kill(step, self.layout.info.rank)
        self._step = step
        inputs, targets = self._rank_batch(step)
        if self.built.pipeline is not None:
            loss = self.built.pipeline.forward_backward(inputs, targets, self.built.autocast)
        else:
            loss = self._micro_batches(inputs, targets, step)
        grad_norm, grad_scale = self.clipper(self.model)
        if self.guard.uses_lag():
            return self._lagged_update(step, loss, grad_norm, grad_scale)
        status = self.guard.check(step, loss, grad_norm)
        if not (status.nonfinite or status.skip):
            optimizer_step(self.optimizer, grad_scale=grad_scale)
        if not status.nonfinite:
            self.scheduler.step()
        self.zero_grad()
        return loss, grad_norm, status

    def _rank_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of global batch ``step`` on the device (its sample ids logged with log_sample_ids)."""
        layout = self.layout
        inputs, targets, ids = self.sources.train.rank_batch(step, layout.dp_rank, layout.dp_world)
        if self._sample_log is not None:
            self._sample_log.write(json.dumps({"step": step, "ids": ids.tolist()}) + "\n")
        gpu = hardware.is_gpu(layout.device)
        return inputs.to(layout.device, non_blocking=gpu), targets.to(layout.device, non_blocking=gpu)

    def _micro_batches(self, inputs: torch.Tensor, targets: torch.Tensor, step: int) -> torch.Tensor:
        """Forward and backward of the step's micro-batches (eager, or replays of the captured graph) inside the model
        family's step context; returns the sum of their losses (each already divided by grad_accum)."""
        plan, graphed = self.layout.plan, self.graphed
        micro = plan.micro_batch
        loss = torch.zeros((), device=self.layout.device)
        with self.built.step_context(graphed is not None):
            for i in range(plan.grad_accum):
                sl = slice(i * micro, (i + 1) * micro)
                if graphed is not None:
                    loss += graphed(inputs[sl], targets[sl])
                else:
                    last = i == plan.grad_accum - 1
                    loss += self.forward_backward(inputs[sl], targets[sl], sync=last, step=step)
        return loss

    def _lagged_update(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, grad_scale: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, StepStatus]:
        """train.lagged_checks: read the previous step's agreed flags (done on the device by now), then launch this
        step's agreement and its update, which the fused optimizer skips on the device when the gradients are not
        finite. A previous non-finite step ends here: its update was skipped, this step's gradients are dropped, and
        its status (``.step`` = step - 1) makes the loop rewind one step and stop. The previous step's stop and
        checkpoint flags are acted on after this step."""
        previous = self.guard.resolve()
        if previous is not None and previous.nonfinite:
            self.zero_grad()
            return loss, grad_norm, previous
        found_inf = self.guard.launch(step, loss, grad_norm)
        optimizer_step(self.optimizer, grad_scale=grad_scale, found_inf=found_inf)
        self.scheduler.step()
        self.zero_grad()
        status = previous or StepStatus(step=step)
        return loss, grad_norm, StepStatus(stop=status.stop, checkpoint_due=status.checkpoint_due, step=step)

    def _pipeline_loss(self, loss: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # noqa: ARG002
        """The schedule's loss function: the last stage already returns its micro-batch's mean token loss."""
        return self.guard.poison(self._step, self.layout.info.rank, loss)

    def zero_grad(self) -> None:
        """Drop the step's gradients: freed (set to None), or zeroed in place when a captured graph writes to them or
        they are views of DDP's buckets (``parallel.ddp_bucket_view``)."""
        if self.graphed is not None and self.graphed.graph is not None:
            self.graphed.zero_grads()
        else:
            bucket_views = self.cfg.parallel.ddp_bucket_view and self.strategy in ("ddp", "zero1")
            self.optimizer.zero_grad(set_to_none=not bucket_views)

    # ----------------------------------------------------------------------------------------------------------------
    # loop

    def train(self) -> dict:
        """Train from the current step to ``train.steps`` (``train.stop_at_step``) and return the summary. An
        exception on the way is recorded in RUN/status.json (``failed``: its one-line message and exit code)."""
        try:
            return self._train()
        except BaseException as exc:
            self._record_failure(exc)
            raise
        finally:
            self.guard.uninstall()

    def _train(self) -> dict:
        cfg = self.cfg.train
        step = self.progress["step"]
        end = min(cfg.steps, cfg.stop_at_step or cfg.steps)
        self._end_step = end
        if step >= end:
            return self._already_complete(step)
        first_val = last_val = self._start(step)
        p = self.cfg.profile
        profile_dir = self.run_dir / "profile" if self.run_dir is not None else Path("profile")
        rank, device = self.layout.info.rank, self.layout.device
        profiler = StepProfiler(p.start_step, p.steps, profile_dir, rank, device, p.trace, p.memory_snapshot)
        first_step = step
        gc_was_enabled = gc.isenabled()
        if cfg.gc_interval > 0:
            gc.disable()
            gc.collect(1)
        try:
            while step < end:
                if cfg.gc_interval > 0 and step > first_step and step % cfg.gc_interval == 0:
                    gc.collect(1)
                profiler.before_step(step - first_step)
                loss, grad_norm, status = self.train_step(step)
                profiled = profiler.after_step(step - first_step)
                if profiled is not None:
                    where = f"profile of step {step + 1}, rank {self.layout.info.rank}"
                    self.log.print(format_summary(profiled, where))
                step = self._count_step(step, loss, status, end)
                last_val = self._after_step(step, end, grad_norm, status, last_val)
        finally:
            if gc_was_enabled:
                gc.enable()
            if self.checkpointer is not None:
                self.checkpointer.wait()
        return self._finish(first_val, last_val)

    def _start(self, step: int) -> float | None:
        """Before this invocation's first step: the signal handlers, the resume marker, a stop signalled meanwhile,
        the step-0 evaluation (returns its loss, or None), the log window and the meter."""
        self.guard.install()  # (a run's trainer installed it when it started)
        if self._resume_record is not None:  # before the records that replace the previous invocation's
            self.log.log(self._resume_record, kind="resume")
        self._stop_if_signalled(step)
        first_val = self.evaluator.evaluate_and_log(step) if step == 0 and self.evaluator.batches else None
        if first_val is not None:
            self._stop_if_signalled(step)  # a SIGTERM during the step-0 evaluation
        self.window = self._metric_window()
        self.meter.start(step, self.progress["tokens_seen"])
        return first_val

    def _after_step(
        self, step: int, end: int, grad_norm: torch.Tensor, status: StepStatus, last_val: float | None
    ) -> float | None:
        """After ``step`` steps: the log record and evaluation that are due, then ``maybe_checkpoint``. Returns the
        latest validation loss."""
        cfg = self.cfg.train
        # records at the log interval and at train.steps only: a stop elsewhere (stop_at_step, a signal) saves the
        # open window in its checkpoint, so a resumed run logs what an uninterrupted one does
        if step % cfg.log_interval == 0 or step == cfg.steps:
            self._log_train(step, self.window.mean(), grad_norm)
            self.window.reset()
        else:
            if step == end:  # the invocation's last steps count in the summary's throughput
                self.meter.end_lap()
            self.log.advance(step)
        eval_due = cfg.eval_interval and step % cfg.eval_interval == 0
        # the final evaluation at train.steps only: a planned stop (stop_at_step) writes no record the
        # uninterrupted run would not have
        if self.evaluator.batches and (eval_due or step == cfg.steps) and not status.stop:
            last_val = self.evaluator.evaluate_and_log(step)
            self.meter.throughput.reset()
        self.maybe_checkpoint(step, end, status)
        return last_val

    def maybe_checkpoint(self, step: int, end: int, status: StepStatus) -> None:
        """After ``step`` steps: save when the interval, the end (``checkpoint.save_final``), the guard's timed
        checkpoint or a stop asks for it, then stop on a preemption."""
        if self._checkpoint_due(step) or status.checkpoint_due or status.stop:
            self._save(step, final=step == end or status.stop)
            self.meter.throughput.reset()
        if status.stop:
            self._stop_preempted(step)

    def _count_step(self, step: int, loss: torch.Tensor, status: StepStatus, end: int) -> int:
        """After ``train_step(step)``: stop on a non-finite verdict, count the step (progress, log window,
        throughput) and, with lagged checks at a sync point, act on the step's own flags (merged into ``status``).
        Returns the steps done."""
        if self.checkpointer is not None:
            self.checkpointer.poll()
        if status.nonfinite:
            self._stop_nonfinite(status.step, status.grad_norm)
        step += 1
        self.progress["step"] = step
        self.progress["tokens_seen"] += self.tokens_per_step
        self.window.add(loss)
        self.meter.throughput.add(self.tokens_per_step)
        if self.guard.uses_lag() and self._sync_point(step, end, status):
            late = self.guard.resolve()  # this step's own flags, before anything is logged or saved
            if late is not None and late.nonfinite:
                self._stop_nonfinite(late.step, late.grad_norm)
            if late is not None:
                status.stop = status.stop or late.stop
                status.checkpoint_due = status.checkpoint_due or late.checkpoint_due
        return step

    def _already_complete(self, step: int) -> dict:
        """A resume at or past this invocation's last step: nothing to train, and the run's records stay as they are
        (config.yaml and status.json are put back, summary.json and metrics.jsonl are not written)."""
        train = self.cfg.train
        stopping_early = self._end_step < train.steps
        limit = f"train.stop_at_step {train.stop_at_step}" if stopping_early else f"train.steps {train.steps}"
        if self.layout.info.is_main and self.run_dir is not None:
            self._run.restore(step)
        self.log.print(f"{self.run_dir}: the run is already complete at step {step} ({limit}); nothing to train")
        run_dir = str(self.run_dir) if self.run_dir is not None else None
        return {"run_dir": run_dir, "steps": step, "already_complete": True, "world_size": self.layout.info.world_size}

    def _stop_if_signalled(self, step: int) -> None:
        """Before the first step (and after the step-0 evaluation): a SIGTERM / SIGINT that reached any rank since
        the trainer started stops the run here, in the state of step ``step`` (its checkpoint, or a fresh start)."""
        if self.guard.signal_reached_any_rank():
            self._stop_preempted(step)

    def _record_failure(self, exc: BaseException) -> None:
        """RUN/status.json of an invocation that ends on an exception (``RunDir.record_failure``; rank 0 of a run dir
        only): a preemption or a non-finite stop has recorded its own state."""
        if self._run is not None and self.layout.info.is_main and not isinstance(exc, Preempted):
            self._run.record_failure(exc, self.progress["step"])

    def _metric_window(self) -> MetricWindow:
        """The log window, and the spike guard's state, as a resumed checkpoint left them (empty on a fresh run)."""
        saved, info = self.state.metrics, self.layout.info
        if saved and saved["spike"]:
            self.guard.load_spike_state(saved["spike"])
        return MetricWindow.restored(self.layout.device, saved, info.rank, info.world_size, self.built.loss_ranks)

    def _metrics_state(self) -> dict:
        """What ``_metric_window`` restores: every rank's window loss sum (a collective: all ranks save together)."""
        window = self.window
        sums = gather_object(window.loss.item() if window is not None else 0.0)
        steps = window.steps if window is not None else 0
        spike = self.guard.spike_state()
        return {"window_loss": sums, "window_steps": steps, "loss_ranks": self.built.loss_ranks, "spike": spike}

    def _save(self, step: int, final: bool = False) -> None:
        if self.checkpointer is None:  # a trainer without a run directory writes nothing
            return
        self.state.metrics = self._metrics_state()
        self.checkpointer.save(step, self.state, asynchronous=self.cfg.checkpoint.async_save and not final)
        self.guard.saved()

    def _sync_point(self, step: int, end: int, status: StepStatus) -> bool:
        """Whether the loop synchronises after ``step`` steps anyway (log, eval, checkpoint, end): the lagged checks
        are read there, so that nothing is logged or saved before the step's verdict."""
        cfg = self.cfg.train
        eval_due = self.evaluator.batches and cfg.eval_interval and step % cfg.eval_interval == 0
        due = step % cfg.log_interval == 0 or step == end or eval_due or self._checkpoint_due(step)
        return bool(due or status.checkpoint_due or status.stop)

    def _rewind_to(self, step: int) -> None:
        """Lagged checks found step ``step`` (0-based) non-finite after the loop had counted it: put the progress and
        the LR schedule back to ``step`` steps (the weights and the optimizer's step count never moved: found_inf)."""
        n = self.progress["step"] - step
        if n <= 0:
            return
        self.progress["step"] = step
        self.progress["tokens_seen"] -= n * self.tokens_per_step
        rewind_scheduler(self.scheduler, self.optimizer, n)

    def _stop_nonfinite(self, step: int, grad_norm: float) -> None:
        """Every rank got the same verdict: keep the last good state (weights after the previous step), then stop. The
        checkpoint is the one a clean stop at that step writes (its log window as that step left it: a bad step the
        lagged checks had counted is taken out of it)."""
        if self.progress["step"] > step and self.window is not None:
            self.window.drop_last()  # counted one step ahead (lagged checks): the bad step was the window's last add
        self._rewind_to(step)
        saved = ""
        if step > 0 and self.checkpointer is not None:  # save() finishes a save in flight first, keeps a committed one
            self._save(step, final=True)
            saved = f"; the state before it is saved as {self.checkpointer.path_for(step)}"
        message = (
            f"step {step + 1}: non-finite loss or gradient norm ({grad_norm}) on at least one rank; stopped "
            f"before the optimizer step{saved}"
        )
        if self.layout.info.is_main and self.run_dir is not None:
            self._run.record("failed", step=step, message=message, exit_code=TrainingError.exit_code)
        raise TrainingError(message)

    def _stop_preempted(self, step: int) -> None:
        """Every rank saved ``step`` (or it is step 0: nothing to save): record the preemption in RUN/status.json
        (before any rank exits: torchrun stops the other workers as soon as one exits), then exit 143 / 130."""
        code, name = self.guard.exit_code(), self.guard.signal_name()
        if self.checkpointer is None:
            raise Preempted(f"{name} at step {step} (exit {code}); no run directory, nothing saved", code)
        checkpoint = self.checkpointer.path_for(step) if step > 0 else None
        if self.layout.info.is_main:
            path = str(checkpoint) if checkpoint else None
            self._run.record("preempted", step=step, signal=name, exit_code=code, checkpoint=path)
        barrier()
        saved = f"checkpoint {checkpoint} saved" if checkpoint else "before the first step, nothing to save"
        hint = "continue with --resume or checkpoint.auto_resume"
        raise Preempted(f"{name} at step {step}: {saved} (exit {code}); {hint}", code)

    def _checkpoint_due(self, step: int) -> bool:
        c = self.cfg.checkpoint
        if self.checkpointer is None:
            return False
        return bool(c.interval and step % c.interval == 0) or (c.save_final and step == self._end_step)

    # ----------------------------------------------------------------------------------------------------------------
    # records

    def _log_train(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """A log step's record: the window's global mean loss and the step's figures (host syncs: log steps only)."""
        loss_value = global_mean(loss, self.built.loss_ranks).item()
        speed = self.meter.lap(step, self.cfg.train.steps)
        record = {
            "step": step,
            "loss": loss_value,
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": grad_norm.item(),
            "tokens_seen": self.progress["tokens_seen"],
            **speed,
            **self.sources.shares(step),
            "skipped_steps": self.guard.skipped_steps,
            "grad_comm_bytes": self.built.grad_comm.bytes_per_step(),
            **self.meter.energy_figures(self.progress["tokens_seen"]),
        }
        self.log.log(record)

    def _finish(self, first_val: float | None, last_val: float | None) -> dict:
        info, checkpointer = self.layout.info, self.checkpointer
        latest = checkpointer.latest() if info.is_main and checkpointer is not None else None
        model = self.built.accounting_model
        summary = {
            "run_dir": str(self.run_dir) if self.run_dir is not None else None,
            "steps": self.progress["step"],
            "tokens_seen": self.progress["tokens_seen"],
            "first_val_loss": first_val,
            "final_val_loss": last_val,
            **self.meter.summary(self.progress["tokens_seen"]),
            "world_size": info.world_size,
            "strategy": self.strategy,
            "step_checks": "lagged" if self.guard.uses_lag() else "every step",
            "cuda_graph_replays": self.graphed.replays if self.graphed is not None else None,
            "wall_s": time.perf_counter() - self._started,  # this invocation, from the trainer's start
            "cpu_affinity": self.layout.affinity_per_rank,
            "dtype": str(self.built.dtype).replace("torch.", ""),
            "params": model.num_params(),
            "params_non_embedding": model.num_params(exclude_embedding=True),
            "flops_per_token": self.meter.flops_per_token,
            "checkpoint": str(latest) if latest else None,
            "hardware": hardware.summary(self.layout.device, self.cfg.train.peak_tflops or None),
            "config": to_dict(self.cfg),
        }
        if info.is_main and self.run_dir is not None:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
            self._run.record("finished", step=self.progress["step"], checkpoint=summary["checkpoint"])
        return summary

    def close(self) -> None:
        self.guard.uninstall()
        if self.graphed is not None:  # first: a graph holding NCCL work would stall the process group's shutdown
            try:
                self.graphed.release()
            except Exception as exc:  # a sticky device error: report it, do not mask the run's own error
                self.log.print(f"warning: could not release the CUDA graph: {exc}")
        self.meter.close()
        self.log.close()
        if self._sample_log is not None:
            self._sample_log.close()
        if self._run is not None and self._run.lock is not None:
            self._run.lock.release()
        wrapper = self.built.release_ddp_wrapper()  # while the process group is still registered
        if wrapper is not None and self.state.model is wrapper:
            self.state.model = self.built.model


def run_training(
    cfg: RunConfig,
    run_dir: str | None = None,
    resume: bool = False,
    overwrite: bool = False,
    resume_allow: tuple[str, ...] = (),
) -> dict:
    trainer = Trainer(cfg, run_dir=run_dir, resume=resume, overwrite=overwrite, resume_allow=resume_allow)
    try:
        return trainer.train()
    finally:
        trainer.close()


__all__ = ["Trainer", "run_training"]
