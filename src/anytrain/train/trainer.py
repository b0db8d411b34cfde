"""The training loop: one process per device, same code for 1 process, DDP and FSDP, CPU and GPU.

Host/device synchronisation happens only on log and eval steps, and once per step for the finite check
(``train.check_finite``, which reads the global gradient norm so every rank takes the same decision).

``Trainer`` holds the set-up, the step, the loop, logging and checkpoint / stop handling; its model and layout
construction is in train/build.py (``ModelSetup`` and the helpers ``compute_dtype``, ``clip_in_optimizer``,
``lagged_checks_apply``), its validation loss in train/evaluation.py (``Evaluation``).
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from anytrain import hardware
from anytrain.config import RunConfig, to_dict
from anytrain.data.loader import BatchProvider, BatchSource, SampleIndex
from anytrain.data.mixture import open_mixture
from anytrain.data.sft import masked_sources
from anytrain.data.shards import TokenDataset
from anytrain.errors import AnytrainError, RunDirError, TrainingError
from anytrain.evals.hf import init_from_hf
from anytrain.kernels import configure as configure_kernels
from anytrain.kernels import mamba_inner, wide_mm
from anytrain.models import build_model, get_spec
from anytrain.parallel import parallelize
from anytrain.parallel.collectives import barrier, gather_object
from anytrain.parallel.data_parallel import gradient_sync, unwrap
from anytrain.parallel.env import DistInfo
from anytrain.parallel.fp8 import attach_fp8
from anytrain.parallel.tensor_parallel import reduce_partial_gradients
from anytrain.train import rundir
from anytrain.train.build import (
    ModelSetup,
    check_data_fits_model,
    clip_in_optimizer,
    compute_dtype,
    init_weights,
    lagged_checks_apply,
    setup_document_mask,
)
from anytrain.train.checkpoint import Checkpointer, TrainState
from anytrain.train.energy import EnergyMeter, energy_metrics
from anytrain.train.evaluation import Evaluation
from anytrain.train.guard import Preempted, StepGuard, StepStatus
from anytrain.train.metrics import MetricsLogger, MetricWindow, ThroughputMeter, mfu, process_peak_rss_gib
from anytrain.train.profiling import StepProfiler, format_summary
from anytrain.train.wandb_sink import require_wandb


class Trainer(ModelSetup, Evaluation):
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
        self._status_recorded = False  # whether RUN/status.json already says how this invocation ends
        try:
            self._setup(cfg, batches, run_dir, resume, overwrite, resume_allow)
        except BaseException as exc:
            if getattr(self, "guard", None) is not None:
                self.guard.uninstall()
            self._record_failure(exc)
            raise

    def _setup(
        self,
        cfg: RunConfig,
        batches: BatchProvider | None,
        run_dir: str | None,
        resume: bool,
        overwrite: bool,
        resume_allow: tuple[str, ...],
    ) -> None:
        self.cfg = cfg
        require_wandb(cfg.metrics.wandb)  # metrics.wandb without the package: one line, before anything is written
        self._setup_layout()
        self.guard = StepGuard(cfg, self.device, self.info.is_main, self.info.world_size)
        if batches is None or run_dir is not None:  # a run: a SIGTERM from here on is a clean stop (train())
            self.guard.install()
        self.dataset = None if batches is not None else TokenDataset(cfg.data.path)
        if self.dataset is not None:
            check_data_fits_model(self.dataset, self.model_args, cfg.data.seq_len)
        writes = batches is None or run_dir is not None
        resume = resume or cfg.checkpoint.auto_resume
        self.run_dir = self._setup_run_dir(run_dir, resume, overwrite, resume_allow) if writes else None
        self.log = MetricsLogger(self.run_dir, self.info.is_main, cfg.train.steps, run_config=cfg)
        if not hardware.is_gpu(self.device):
            self.log.memory_label = "rss"  # peak_mem_gib on CPU: the process's peak resident set (_peak_memory_gib)
        if self._auto_reason:
            self.log.print(f"parallel.auto: {self._auto_reason}")
        self.dtype = compute_dtype(cfg, self.device)
        self._build_model()
        setup_document_mask(cfg, self.raw_model, self.dataset, batches)
        self.progress: dict = {"step": 0, "tokens_seen": 0}
        self.state = TrainState(self.model, self.optimizer, self.scheduler, self.progress,
                                extras=self.grad_comm.checkpoint_state(self.progress, self.log.print))  # fmt: skip
        self.checkpointer = None
        if self.run_dir is not None:
            self.checkpointer = Checkpointer(self.run_dir / "checkpoints", cfg.checkpoint.keep_last,
                                             self.info.is_main, log=self.log.print,
                                             checksums=cfg.checkpoint.checksums)  # fmt: skip
            if resume:
                self._resume()
        self._setup_batches(batches)
        self.flops_per_token = self.accounting_model.flops_per_token(cfg.data.seq_len)
        self.peak_flops = hardware.peak_flops(self.device, cfg.train.peak_tflops or None)
        self._log_model_size()
        self.guard.loss_ranks = self.loss_ranks
        self.guard.lagged = lagged_checks_apply(cfg, self.optimizer)
        self._clip_in_optimizer = cfg.train.clip_in_optimizer and clip_in_optimizer(self.optimizer, self.strategy,
                                                                                     self.dims)  # fmt: skip
        self._setup_cuda_graphs()
        # Power of this rank's device (NVML / AMD SMI); rank 0 scales it to the job. Absent on CPU: values are null.
        self.energy = EnergyMeter(self.device.index or 0) if hardware.is_gpu(self.device) else None
        logs_samples = cfg.train.log_sample_ids and self.run_dir is not None
        self._sample_log = self._open_sample_log() if logs_samples else None

    def _setup_batches(self, batches: BatchProvider | None) -> None:
        """The training batches (the prepared dataset's, or ``batches``) and the validation ones (dataset only)."""
        seq_len, global_batch, seed = self.cfg.data.seq_len, self.plan.global_batch, self.cfg.train.seed
        self.tokens_per_step = global_batch * seq_len
        self.val_sources = None  # data.sources: each source's validation batches, by name
        if batches is not None:
            self.train_source, self.val_source = batches, None
            return
        if self.cfg.data.sources:  # a weighted mixture of datasets (data/mixture.py)
            self.train_source, self.val_sources = open_mixture(self.cfg.data.sources, self.dataset, seq_len,
                                                               global_batch, seed)  # fmt: skip
            self.val_source = next(iter(self.val_sources.values()))
            return
        masked = masked_sources(self.dataset, seq_len, global_batch, seed)  # prepare-sft data: loss mask (data/sft.py)
        if masked is not None:
            self.train_source, self.val_source = masked
            return
        self.train_source = BatchSource(SampleIndex(self.dataset.split("train"), seq_len, "train"), global_batch, seed)
        self.val_source = BatchSource(SampleIndex(self.dataset.split("val"), seq_len, "val"), global_batch, seed,
                                      shuffle=False)  # fmt: skip

    # ----------------------------------------------------------------------------------------------------------------
    # set-up

    def _open_sample_log(self):
        """Per-rank log of consumed sample ids; on resume, entries past the checkpoint's step are dropped so the log
        is exactly the samples that trained the weights."""
        path = self.run_dir / f"samples_rank{self.info.rank}.jsonl"
        if path.exists():
            kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] < self.progress["step"]]
            path.write_text("".join(line + "\n" for line in kept))
        return open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()

    def _setup_run_dir(self, run_dir: str | None, resume: bool, overwrite: bool, allow: tuple[str, ...]) -> Path:
        """Marker, lock (rank 0, for the run's lifetime) and, on resume, the config comparison: train/rundir.py."""
        self._run = rundir.setup_run_dir(self.cfg, run_dir, resume, overwrite, allow, self.info.is_main)
        return self._run.path

    def _build_model(self) -> None:
        # train.attention_backend: the SDPA kernel order, set before any block is compiled (a compiled graph keeps the
        # kernel chosen while it was traced); nothing to set for auto and on CPU
        hardware.set_attention_backend(self.cfg.train.attention_backend)
        configure_kernels(self.cfg.kernels)  # the kernels' process-wide options (RunConfig.kernels)
        spec = get_spec(self.cfg.model.arch)
        with torch.device("meta"):
            full = spec.build(self.model_args)
        self.accounting_model = full  # the whole model on the meta device: parameter and FLOP counts
        self.pp_schedule, self.pp_first, self.pp_last = None, True, True
        if self.dims.pp > 1:
            self._build_pipeline(spec)
        else:
            model = full
            init_weights(model, self.device, self.cfg.train.seed, self.cfg.model.init_device)
            self.raw_model = model
            init_from_hf(model, self.cfg.model, self.log.print)  # model.init_from: HF weights (evals/hf.py)
            self.model, self.strategy = parallelize(model, self.cfg, self.dims, self.device, self.dtype)
        # ranks holding a copy of the loss: all but the non-final pipeline stages (TP peers hold equal copies)
        self.loss_ranks = self.info.world_size // self.dims.pp
        self._setup_optimizer()
        attach_fp8(self.optimizer, self.model, self.log.print)  # train.fp8: its log line; FSDP's FP8 weight scales

    def _zero_grad(self) -> None:
        """Drop the step's gradients: freed (set to None), or zeroed in place when a captured graph writes to them."""
        if getattr(self, "_graphed", None) is not None and self._graphed.graph is not None:
            self._graphed.zero_grads()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _resume(self) -> None:
        for change in self._run.changes:
            self.log.print(f"resume: changed {change}")
        try:
            latest = self.checkpointer.load_newest(self.state, set_aside=True)
        except RunDirError:
            if self.info.is_main:
                self._run.restore_config()
            raise
        if latest is None:
            self.log.print(f"no committed checkpoint in {self.checkpointer.dir}: starting from step 0")
        else:
            self.log.print(f"resumed from {latest} (step {self.progress['step']})")
        # the marker that makes readers drop the records logged after this step by the previous invocation
        self._resume_record = {"step": self.progress["step"], "checkpoint": str(latest) if latest else None}

    # ----------------------------------------------------------------------------------------------------------------
    # steps

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, sync: bool, step: int = 0) -> torch.Tensor:
        """One micro-batch: (b, T) ids -> mean token loss / grad_accum, gradients accumulated. Returns the loss."""
        keep_gathered = self.plan.grad_accum > 1 and not self.cfg.parallel.reshard_during_accumulation
        with gradient_sync(self.model, self.strategy, sync, keep_gathered=keep_gathered):
            with self._autocast():
                loss = self.model(inputs, targets) / self.plan.grad_accum  # mean token loss of the micro-batch
            loss = self.guard.poison(step, self.info.rank, loss)
            # one process: from the second micro-batch on, transformer.Linear's weight gradients are summed into .grad
            # by their GEMMs (no DDP reducer hooks here; CUDA-graph steps do not come here)
            with wide_mm.accumulate_in_gemm(self.strategy == "single"):
                loss.backward()
        return loss.detach()

    def train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor, StepStatus]:
        """Optimizer step ``step`` (0-based) on this rank's slice of global batch ``step``.

        The optimizer step is skipped (and the caller stops) when the agreed status says the gradients are not
        finite; it is skipped and counted when the spike guard fires.
        """
        self.guard.maybe_kill(step, self.info.rank)
        self._step = step
        inputs, targets, ids = self.train_source.rank_batch(step, self.dp_rank, self.dp_world)
        if self._sample_log is not None:
            self._sample_log.write(json.dumps({"step": step, "ids": ids.tolist()}) + "\n")
        gpu = hardware.is_gpu(self.device)
        inputs = inputs.to(self.device, non_blocking=gpu)
        targets = targets.to(self.device, non_blocking=gpu)
        if self.pp_schedule is not None:
            loss = self.pipeline_forward_backward(inputs, targets)
        else:
            micro = self.plan.micro_batch
            loss = torch.zeros((), device=self.device)
            graphed = getattr(self, "_graphed", None)
            with self._weight_casts(graphed):
                for i in range(self.plan.grad_accum):
                    sl = slice(i * micro, (i + 1) * micro)
                    if graphed is not None:
                        loss += graphed(inputs[sl], targets[sl])
                    else:
                        last = i == self.plan.grad_accum - 1
                        loss += self.forward_backward(inputs[sl], targets[sl], sync=last, step=step)
        try:
            grad_norm = self._clip_gradients()
            if self.guard.uses_lag():
                return self._lagged_update(step, loss, grad_norm)
            status = self.guard.check(step, loss, grad_norm)
            if not (status.nonfinite or status.skip):
                self.optimizer.step()
        finally:
            self.optimizer.__dict__.pop("grad_scale", None)  # this step's clipping factor (_clip_gradients)
        if not status.nonfinite:
            self.scheduler.step()
        self._zero_grad()
        return loss, grad_norm, status

    def _weight_casts(self, graphed) -> contextlib.AbstractContextManager:
        """The fused Mamba mixer's weight casts shared by one optimizer step's micro-batches
        (``mamba_inner.cached_weight_casts``), where the parameters are the module's own full tensors (one process,
        DDP, ZeRO-1): not under FSDP / TP (sharded, gathered per use), not for CUDA graphs (each replay casts inside
        the graph); pipeline steps do not come here. Closed before the optimizer step, which changes the weights."""
        if graphed is not None or self.strategy not in ("single", "ddp", "zero1"):  # (TP/PP runs are FSDP or none)
            return contextlib.nullcontext()
        return mamba_inner.cached_weight_casts()

    def _lagged_update(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor):
        """train.lagged_checks: read the previous step's agreed flags (done on the device by now), then launch this
        step's agreement and its update, which the fused optimizer skips on the device when the gradients are not
        finite. A previous non-finite step ends here: its update was skipped, this step's gradients are dropped, and
        its status (``.step`` = step - 1) makes the loop rewind one step and stop. The previous step's stop and
        checkpoint flags are acted on after this step."""
        previous = self.guard.resolve()
        if previous is not None and previous.nonfinite:
            self._zero_grad()
            return loss, grad_norm, previous
        self.optimizer.found_inf = self.guard.launch(step, loss, grad_norm)
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf
        self.scheduler.step()
        self._zero_grad()
        status = previous or StepStatus(step=step)
        return loss, grad_norm, StepStatus(stop=status.stop, checkpoint_due=status.checkpoint_due, step=step)

    def pipeline_forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule runs every micro-batch of this rank's batch through the stages (forward and backward): the
        first stage's rank passes the token ids, the last stage's rank the targets (to the schedule, and to the last
        stage's forward, which returns the micro-batch's mean loss). The schedule averages gradients over
        micro-batches. Returns the mean loss on the last stage's ranks, 0 elsewhere (no host sync here)."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.pp_first else ()
        kwargs = dict(target=targets, losses=losses, targets=targets) if self.pp_last else {}
        with self._autocast():
            self.pp_schedule.step(*args, **kwargs, **self._pp_step_kwargs)
        if self.pp_last:
            return torch.stack([x.detach().float() for x in losses]).mean()
        return torch.zeros((), device=self.device)

    def _pipeline_loss(self, loss: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # noqa: ARG002
        """The schedule's loss function: the last stage already returns its micro-batch's mean token loss."""
        return self.guard.poison(self._step, self.info.rank, loss)

    def _clip_gradients(self) -> torch.Tensor:
        """Global gradient norm (all ranks agree), clipping to train.grad_clip when > 0: here, or
        (``clip_in_optimizer``) by this step's fused AdamW, which divides the gradients by ``optimizer.grad_scale`` as
        it reads them (until then, and on a skipped step, ``.grad`` stays unclipped)."""
        max_norm = self.cfg.train.grad_clip or math.inf
        if self.dims.tp > 1:
            reduce_partial_gradients(self.model.parameters())
        if math.isfinite(max_norm) and self._clip_in_optimizer:  # decided once, in __init__
            # the fused AdamW divides each gradient by its grad_scale as it reads it (written back, as clipping would):
            # no separate pass that scales every gradient in place
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
            self.optimizer.grad_scale = torch.clamp((norm.float() + 1e-6) / max_norm, min=1.0)
            return norm
        if self.dims.tp == 1 and self.dims.pp == 1:  # every parameter on one mesh: torch's own clipping
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=True)
            return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor
        # TP/PP: parameters live on different meshes (or stages); sum squared norms per mesh, then over stages
        params = [p for p in self.model.parameters() if p.grad is not None]
        groups: dict = {}
        for p in params:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
        squared = torch.zeros((), device=self.device)
        for grads in groups.values():
            norm = torch.nn.utils.get_total_norm(grads, foreach=False)
            squared = squared + (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).float() ** 2
        if self.dims.pp > 1:
            dist.all_reduce(squared, group=self.dims.build_mesh(self.device.type)["pp"].get_group())
        total = squared.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=False)
        return total

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
        self.guard.install()  # (a run's trainer installed it when it started)
        if self._resume_record is not None:  # before the records that replace the previous invocation's
            self.log.log(self._resume_record, kind="resume")
        self._stop_if_signalled(step)
        first_val = self._eval_and_log(step) if step == 0 and self._eval_batches() else None
        if first_val is not None:
            self._stop_if_signalled(step)  # a SIGTERM during the step-0 evaluation
        meter = ThroughputMeter()
        self.window = self._metric_window()
        hardware.reset_peak_memory(self.device)
        last_val = first_val
        rates: list[float] = []
        self._energy_start = (time.perf_counter(), self.progress["tokens_seen"])
        if self.energy is not None:
            self.energy.start()
        p = self.cfg.profile
        profile_dir = self.run_dir / "profile" if self.run_dir is not None else Path("profile")
        profiler = StepProfiler(p.start_step, p.steps, profile_dir, self.info.rank, self.device, p.trace)
        first_step = step
        self._pace_start = (time.perf_counter(), step)  # the ETA: this invocation's pace, evals and saves included
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
                    self.log.print(format_summary(profiled, f"profile of step {step + 1}, rank {self.info.rank}"))
                if self.checkpointer is not None:
                    self.checkpointer.poll()
                if status.nonfinite:
                    self._stop_nonfinite(status.step, status.grad_norm)
                step += 1
                self.progress["step"] = step
                self.progress["tokens_seen"] += self.tokens_per_step
                self.window.add(loss)
                meter.add(self.tokens_per_step)
                if self.guard.uses_lag() and self._sync_point(step, end, status):
                    late = self.guard.resolve()  # this step's own flags, before anything is logged or saved
                    if late is not None and late.nonfinite:
                        self._stop_nonfinite(late.step, late.grad_norm)
                    if late is not None:
                        status.stop = status.stop or late.stop
                        status.checkpoint_due = status.checkpoint_due or late.checkpoint_due
                # records at the log interval and at train.steps only: a stop elsewhere (stop_at_step, a signal)
                # saves the open window in its checkpoint, so a resumed run logs what an uninterrupted one does
                if step % cfg.log_interval == 0 or step == cfg.steps:
                    rates.append(self._log_train(step, self.window.mean(), grad_norm, meter))
                    self.window.reset()
                else:
                    if step == end:  # the invocation's last steps count in the summary's throughput
                        hardware.synchronize(self.device)
                        rates.append(meter.lap()[0])
                    self.log.advance(step)
                eval_due = cfg.eval_interval and step % cfg.eval_interval == 0
                if self._eval_batches() and (eval_due or step == end) and not status.stop:
                    last_val = self._eval_and_log(step)
                    meter.reset()
                if self._checkpoint_due(step) or status.checkpoint_due or status.stop:
                    self._save(step, final=step == end or status.stop)
                    meter.reset()
                if status.stop:
                    self._stop_preempted(step)
        finally:
            if gc_was_enabled:
                gc.enable()
            if self.checkpointer is not None:
                self.checkpointer.wait()
        return self._finish(first_val, last_val, rates)

    def _already_complete(self, step: int) -> dict:
        """A resume at or past this invocation's last step: nothing to train, and the run's records stay as they are
        (config.yaml and status.json are put back, summary.json and metrics.jsonl are not written)."""
        train = self.cfg.train
        stopping_early = self._end_step < train.steps
        limit = f"train.stop_at_step {train.stop_at_step}" if stopping_early else f"train.steps {train.steps}"
        if self.info.is_main and self.run_dir is not None:
            self._run.restore()
            self._status_recorded = True
        self.log.print(f"{self.run_dir}: the run is already complete at step {step} ({limit}); nothing to train")
        run_dir = str(self.run_dir) if self.run_dir is not None else None
        return {"run_dir": run_dir, "steps": step, "already_complete": True, "world_size": self.info.world_size}

    def _stop_if_signalled(self, step: int) -> None:
        """Before the first step (and after the step-0 evaluation): a SIGTERM / SIGINT that reached any rank since
        the trainer started stops the run here, in the state of step ``step`` (its checkpoint, or a fresh start)."""
        if self.guard.signal_reached_any_rank():
            self._stop_preempted(step)

    def _record_failure(self, exc: BaseException) -> None:
        """RUN/status.json of an invocation that ends on an exception: ``failed``, with a one-line message and the
        exit code (a preemption or a non-finite stop has recorded its own state; rank 0 of a run dir only)."""
        if getattr(self, "_run", None) is None or not self.info.is_main or self._status_recorded:
            return
        if isinstance(exc, Preempted):
            return
        if isinstance(exc, KeyboardInterrupt):
            message, code = "interrupted by a second SIGINT; stopped without saving", 130
        elif isinstance(exc, AnytrainError):
            message, code = str(exc), exc.exit_code
        else:
            message, code = f"{type(exc).__name__}: {exc}", 1  # a traceback: the exit code of an uncaught exception
        message = " ".join(message.split())[:2000]
        step = getattr(self, "progress", {}).get("step", 0)
        self._status_recorded = True
        with contextlib.suppress(OSError, AnytrainError):  # a full disk may refuse this file too
            rundir.write_status(self._run.path, "failed", step=step, message=message, exit_code=code)

    def _metric_window(self) -> MetricWindow:
        """The log window, and the spike guard's state, as a resumed checkpoint left them (empty on a fresh run).
        At the saving world size each rank takes its own loss sum back (exact); otherwise the ranks share the total
        so that the logged global mean is the same."""
        window, saved = MetricWindow(self.device), self.state.metrics
        if saved and saved["window_steps"]:
            sums, world = saved["window_loss"], self.info.world_size
            if len(sums) == world and saved["loss_ranks"] == self.loss_ranks:
                window.restore(sums[self.info.rank], saved["window_steps"])
            else:
                window.restore(sum(sums) * self.loss_ranks / (saved["loss_ranks"] * world), saved["window_steps"])
        if saved and saved["spike"]:
            self.guard.load_spike_state(saved["spike"])
        return window

    def _metrics_state(self) -> dict:
        """What ``_metric_window`` restores: every rank's window loss sum (a collective: all ranks save together)."""
        window = getattr(self, "window", None)
        sums = gather_object(window.loss.item() if window is not None else 0.0)
        steps = window.steps if window is not None else 0
        return {"window_loss": sums, "window_steps": steps, "loss_ranks": self.loss_ranks,
                "spike": self.guard.spike_state()}  # fmt: skip

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
        eval_due = self._eval_batches() and cfg.eval_interval and step % cfg.eval_interval == 0
        return bool(step % cfg.log_interval == 0 or step == end or eval_due or self._checkpoint_due(step)
                    or status.checkpoint_due or status.stop)  # fmt: skip

    def _rewind_to(self, step: int) -> None:
        """Lagged checks found step ``step`` (0-based) non-finite after the loop had counted it: put the progress and
        the LR schedule back to ``step`` steps (the weights and the optimizer's step count never moved: found_inf)."""
        n = self.progress["step"] - step
        if n <= 0:
            return
        self.progress["step"] = step
        self.progress["tokens_seen"] -= n * self.tokens_per_step
        sched = self.scheduler  # LambdaLR: its state_dict holds the step count and the last LRs
        state = sched.state_dict()
        state["last_epoch"] -= n
        state["_step_count"] -= n
        state["_last_lr"] = [
            base * factor(state["last_epoch"]) for base, factor in zip(sched.base_lrs, sched.lr_lambdas, strict=True)
        ]
        sched.load_state_dict(state)
        for group, lr in zip(self.optimizer.param_groups, state["_last_lr"], strict=True):
            group["lr"] = lr

    def _stop_nonfinite(self, step: int, grad_norm: float) -> None:
        """Every rank got the same verdict: keep the last good state (weights after the previous step), then stop. The
        checkpoint is the one a clean stop at that step writes (its log window as that step left it: a bad step the
        lagged checks had counted is taken out of it)."""
        if self.progress["step"] > step and getattr(self, "window", None) is not None:
            self.window.drop_last()  # counted one step ahead (lagged checks): the bad step was the window's last add
        self._rewind_to(step)
        saved = ""
        if step > 0 and self.checkpointer is not None:  # save() finishes a save in flight first, keeps a committed one
            self._save(step, final=True)
            saved = f"; the state before it is saved as {self.checkpointer.path_for(step)}"
        message = (f"step {step + 1}: non-finite loss or gradient norm ({grad_norm}) on at least one rank; stopped "
                   f"before the optimizer step{saved}")  # fmt: skip
        if self.info.is_main and self.run_dir is not None:
            rundir.write_status(self.run_dir, "failed", step=step, message=message, exit_code=TrainingError.exit_code)
            self._status_recorded = True
        raise TrainingError(message)

    def _stop_preempted(self, step: int) -> None:
        """Every rank saved ``step`` (or it is step 0: nothing to save): record the preemption in RUN/status.json
        (before any rank exits: torchrun stops the other workers as soon as one exits), then exit 143 / 130."""
        code, name = self.guard.exit_code(), self.guard.signal_name()
        if self.checkpointer is None:
            raise Preempted(f"{name} at step {step} (exit {code}); no run directory, nothing saved", code)
        checkpoint = self.checkpointer.path_for(step) if step > 0 else None
        if self.info.is_main:
            path = str(checkpoint) if checkpoint else None
            rundir.write_status(self.run_dir, "preempted", step=step, signal=name, exit_code=code, checkpoint=path)
            self._status_recorded = True
        barrier()
        saved = f"checkpoint {checkpoint} saved" if checkpoint else "before the first step, nothing to save"
        hint = "continue with --resume or checkpoint.auto_resume"
        raise Preempted(f"{name} at step {step}: {saved} (exit {code}); {hint}", code)

    def _checkpoint_due(self, step: int) -> bool:
        c = self.cfg.checkpoint
        if self.checkpointer is None:
            return False
        return bool(c.interval and step % c.interval == 0) or (c.save_final and step == self._end_step)

    def _log_train(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, meter: ThroughputMeter) -> float:
        loss_value = self._global_mean(loss).item()  # host sync: log steps only
        hardware.synchronize(self.device)
        tokens_per_s, seconds = meter.lap()
        per_device = tokens_per_s / self.info.world_size
        started, start_step = self._pace_start
        pace = (time.perf_counter() - started) / max(step - start_step, 1)  # seconds per step in this invocation
        self.log.log({
            "step": step,
            "loss": loss_value,
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": grad_norm.item(),
            "tokens_seen": self.progress["tokens_seen"],
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": per_device,
            "mfu": mfu(self.flops_per_token, per_device, self.peak_flops),
            "peak_mem_gib": self._peak_memory_gib(),
            "window_s": seconds,
            "eta_s": (self.cfg.train.steps - step) * pace,
            **self._data_shares(step),
            "skipped_steps": self.guard.skipped_steps,
            "grad_comm_bytes": self.grad_comm.bytes_per_step(),
            **self._energy_metrics(),
        })  # fmt: skip
        return tokens_per_s

    def _peak_memory_gib(self) -> float:
        """GPU: the allocator's peak since the reset at the start of training; CPU: this process's peak resident
        set size (its tensors live there; the console calls it rss)."""
        return hardware.peak_memory_gib(self.device) if hardware.is_gpu(self.device) else process_peak_rss_gib()

    def _data_shares(self, step: int) -> dict:
        """data.sources: the share of the sequences of steps [0, step) each source gave (``data_share/NAME``)."""
        if self.val_sources is None:
            return {}
        return {f"data_share/{name}": share for name, share in self.train_source.shares(step).items()}

    def _energy_metrics(self) -> dict:
        """avg_watts, joules, tokens_per_joule, tflops_per_watt since training started in this invocation."""
        reading = self.energy.read() if self.energy is not None else {"joules": None}
        started, tokens_at_start = self._energy_start
        tokens = self.progress["tokens_seen"] - tokens_at_start
        return energy_metrics(reading["joules"], time.perf_counter() - started, tokens, tokens * self.flops_per_token,
                              devices=self.info.world_size)  # fmt: skip

    def _global_mean(self, loss: torch.Tensor) -> torch.Tensor:
        """Mean of a per-rank loss over the ranks that hold one (non-final pipeline stages contribute 0)."""
        if not dist.is_initialized():
            return loss
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total / self.loss_ranks

    def _finish(self, first_val: float | None, last_val: float | None, rates: list[float]) -> dict:
        steady = rates[1:] or rates  # the first window includes warm-up / compilation
        tokens_per_s = sum(steady) / len(steady) if steady else 0.0
        per_device = tokens_per_s / self.info.world_size
        latest = self.checkpointer.latest() if self.info.is_main and self.checkpointer is not None else None
        summary = {
            "run_dir": str(self.run_dir) if self.run_dir is not None else None,
            "steps": self.progress["step"],
            "tokens_seen": self.progress["tokens_seen"],
            "first_val_loss": first_val,
            "final_val_loss": last_val,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": per_device,
            "window_tokens_per_s": rates,
            "mfu": mfu(self.flops_per_token, per_device, self.peak_flops),
            "peak_mem_gib": self._peak_memory_gib(),
            "peak_reserved_gib": hardware.peak_memory_gib(self.device, reserved=True),
            "energy": self._energy_metrics(),
            "world_size": self.info.world_size,
            "strategy": self.strategy,
            "step_checks": "lagged" if self.guard.uses_lag() else "every step",
            "cuda_graph_replays": self._graphed.replays if self._graphed is not None else None,
            "wall_s": time.perf_counter() - self._started,  # this invocation, from the trainer's start
            "cpu_affinity": self._affinity_per_rank,
            "dtype": str(self.dtype).replace("torch.", ""),
            "params": self.accounting_model.num_params(),
            "params_non_embedding": self.accounting_model.num_params(exclude_embedding=True),
            "flops_per_token": self.flops_per_token,
            "checkpoint": str(latest) if latest else None,
            "hardware": hardware.summary(self.device, self.cfg.train.peak_tflops or None),
            "config": to_dict(self.cfg),
        }
        if self.info.is_main and self.run_dir is not None:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
            rundir.write_status(self.run_dir, "finished", step=self.progress["step"], checkpoint=summary["checkpoint"])
            self._status_recorded = True
        return summary

    def close(self) -> None:
        if getattr(self, "guard", None) is not None:
            self.guard.uninstall()
        graphed = getattr(self, "_graphed", None)
        if graphed is not None:  # first: a graph holding NCCL work would stall the process group's shutdown
            try:
                graphed.release()
            except Exception as exc:  # a sticky device error: report it, do not mask the run's own error
                self.log.print(f"warning: could not release the CUDA graph: {exc}")
        if self.energy is not None:
            self.energy.stop()
        self.log.close()
        if self._sample_log is not None:
            self._sample_log.close()
        run = getattr(self, "_run", None)
        if run is not None and run.lock is not None:
            run.lock.release()
        self._release_ddp_wrapper()

    def _release_ddp_wrapper(self) -> None:
        """Drop the DDP wrapper (DDP, ZeRO-1) while the process group is still registered: its C++ Reducer holds a
        reference to the group. ``destroy_process_group`` then drops the group's last reference from Python, whose
        binding releases the GIL while gloo joins its worker threads. Left to the unwinding of an error's traceback
        (a NaN stop raises with the trainer in its frames), the Reducer dropped the last reference after the shutdown,
        with the GIL held, while a gloo worker waited for the GIL to free a finished collective's tensors: the rank
        never exited (``tests/distributed/test_shutdown.py``). The trainer keeps the unwrapped module (same
        parameters); it does not train after ``close``."""
        model = getattr(self, "model", None)
        if model is None or self.strategy not in ("ddp", "zero1"):
            return
        self.model = unwrap(model)
        state = getattr(self, "state", None)
        if state is not None and state.model is model:
            state.model = self.model


def run_training(cfg: RunConfig, run_dir: str | None = None, resume: bool = False, overwrite: bool = False,
                 resume_allow: tuple[str, ...] = ()) -> dict:  # fmt: skip
    trainer = Trainer(cfg, run_dir=run_dir, resume=resume, overwrite=overwrite, resume_allow=resume_allow)
    try:
        return trainer.train()
    finally:
        trainer.close()


__all__ = ["Trainer", "run_training", "DistInfo", "build_model", "unwrap"]
