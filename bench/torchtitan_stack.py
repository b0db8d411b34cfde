"""torchtitan's own trainer as rows of bench/transformer.py (``--stacks torchtitan``).

A torchtitan row is ``torchtitan.train.Trainer(job_config).train()``, unmodified, in a process of its own launched as
torchtitan launches itself (``torchrun --standalone --nproc_per_node 1``); its JobConfig comes from torchtitan's
``ConfigManager`` parsing CLI-style arguments (``titan_argv``). What this file adds goes through torchtitan's
extension points only:

* **TrainSpec ``anytrain_llama3``** (``register_train_spec``): torchtitan's llama3 spec (its Transformer,
  ``parallelize_llama``: AC -> per-block compile; its loss, AdamW, LR schedule) with the flavours of
  ``TORCHTITAN_FLAVOURS``: 0.2.2's llama3 has debugmodel / 8B / 70B / 405B only, so "1B" and "3B" (Llama-3.2's shapes)
  and a tiny "debug" are ``TransformerModelArgs`` here, checked parameter by parameter against anytrain's flavour
  (``check_shapes``: same names and shapes). torchtitan 0.2.2's llama3 cannot tie the LM head to the token embedding
  (its qwen3 can; ``enable_weight_tying``), so its model has one (V, D) matrix more than anytrain's tied
  ``llama-1b`` / ``llama-3b``: the row records both parameter counts. The FLOPs per token are the same (the LM head's
  matmul is counted on both sides).
* **Data**: ``RandomTokenLoader`` yields torchtitan's ``({"input": (B, T)}, labels (B, T))`` micro-batches of the same
  token bank the anytrain rows train on (``bench.common.RandomBatches``: 4 global batches from a seeded generator,
  cycled; step i's global batch split into micro-batches in order), so no tokenizer or dataset is built.
* **Measurement**: ``metrics.log_freq 1`` and a recording logger added to torchtitan's ``MetricsProcessor``
  (``TrainSpec.build_metrics_processor_fn``) keep what torchtitan computes every step (its step time, tokens/s, MFU,
  max active / reserved memory) plus the caching allocator's max allocated bytes of the step (the anytrain rows'
  memory figure). The first ``warmup`` steps (compilation happens there) are skipped, the next ``steps`` are the row.

Standalone (prints one row)::

    PYTHONPATH=/tmp/site:src python -m bench.torchtitan_stack --flavour llama-1b --seq 2048 --micro 8 \\
        --global-batch 32 --precision fp8-rowwise --set activation_checkpoint.mode=none
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from anytrain import hardware
from anytrain.train.profiling import StepProfiler
from bench.common import ROW_MARK, RandomBatches, bench_device, child_env, print_row, row_error

SPEC_NAME = "anytrain_llama3"
TORCHTITAN_FLAVOURS = {"llama-1b": "1B", "llama-3b": "3B", "debug": "debug"}
"""anytrain's Transformer flavour -> the torchtitan flavour of the same shape registered under ``SPEC_NAME``."""
FP8_FILTER = "output,auto_filter_small_kn"
"""torchtitan's float8 filter for the FP8 rows: the LM head stays bf16 and so do the GEMMs too small to gain
(torchao's ``_auto_filter_for_recipe`` thresholds), as anytrain's ``train.fp8_filter: auto`` does."""


def titan_model_args() -> dict[str, Any]:
    """The flavours added to llama3's: Llama-3.2-1B / 3B (meta-llama config.json: ffn_dim_multiplier 1.5 / 1.0 with
    multiple_of 256 give the FFN width 8192 of both) and anytrain's ``debug`` shape for CPU checks."""
    from torchtitan.models.llama3 import TransformerModelArgs

    llama32 = dict(n_kv_heads=8, vocab_size=128256, multiple_of=256, rope_theta=500000)
    return {
        "1B": TransformerModelArgs(dim=2048, n_layers=16, n_heads=32, ffn_dim_multiplier=1.5, **llama32),
        "3B": TransformerModelArgs(dim=3072, n_layers=28, n_heads=24, ffn_dim_multiplier=1.0, **llama32),
        "debug": TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=64),
    }


def check_shapes(flavour: str, model_args: Any) -> dict:
    """Build torchtitan's and anytrain's models of ``flavour`` on the meta device and require the same parameters
    (name -> shape; anytrain's tied head counted as its own matrix), the same eps and RoPE theta. Returns the counts."""
    from torchtitan.models.llama3 import Transformer as TitanTransformer

    from anytrain.config import ModelConfig
    from anytrain.models import build_model, resolve_args

    ours_args = resolve_args(ModelConfig(arch="transformer", flavour=flavour))
    with torch.device("meta"):
        theirs, ours = TitanTransformer(model_args), build_model(ModelConfig(arch="transformer", flavour=flavour))
    their_shapes = {n: tuple(p.shape) for n, p in theirs.named_parameters()}
    our_shapes = {n: tuple(p.shape) for n, p in ours.named_parameters(remove_duplicate=False)}
    if their_shapes != our_shapes:
        diff = sorted(set(their_shapes.items()) ^ set(our_shapes.items()))[:6]
        raise ValueError(f"torchtitan flavour {TORCHTITAN_FLAVOURS[flavour]} is not anytrain's {flavour}: {diff}")
    if (model_args.norm_eps, float(model_args.rope_theta)) != (ours_args.norm_eps, float(ours_args.rope_theta)):
        raise ValueError(f"torchtitan flavour of {flavour}: norm eps / RoPE theta differ from anytrain's")
    return {
        "params": sum(p.numel() for p in theirs.parameters()),
        "anytrain_params": ours.num_params(),
        "tied_embeddings": False,
        "anytrain_tied_embeddings": ours_args.tie_embeddings,
    }


class RandomTokenLoader:
    """torchtitan's dataloader interface (``BaseDataLoader``: iterable + ``state_dict`` / ``load_state_dict``) over
    ``RandomBatches``: step i's global batch, split into micro-batches of ``local_batch_size`` in order."""

    def __init__(self, vocab: int, global_batch: int, micro: int, seq: int) -> None:
        self.batches, self.global_batch, self.micro = RandomBatches(vocab, global_batch, seq), global_batch, micro

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        step = 0
        while True:
            inputs, labels, _ = self.batches.rank_batch(step)  # (G, T) each
            for k in range(0, self.global_batch, self.micro):
                yield {"input": inputs[k : k + self.micro]}, labels[k : k + self.micro]
            step += 1

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


def build_random_loader(dp_world_size: int, dp_rank: int, tokenizer: Any, job_config: Any, **kwargs) -> Any:
    """TrainSpec.build_dataloader_fn: one data-parallel rank only (these rows run on one GPU)."""
    if dp_world_size != 1:
        raise ValueError("the bench's torchtitan rows run on one GPU")
    training = job_config.training
    vocab = titan_model_args()[job_config.model.flavor].vocab_size
    global_batch = training.global_batch_size if training.global_batch_size > 0 else training.local_batch_size
    return RandomTokenLoader(vocab, global_batch, training.local_batch_size, training.seq_len)


class StepRecorder:
    """A logger in torchtitan's ``LoggerContainer`` (``BaseLogger``'s ``log`` / ``close``): keeps each logged
    step's metrics, the caching allocator's max allocated GiB since the previous log (torchtitan resets the peak
    after each log) and the time of the log. With ``profiler`` (anytrain's ``StepProfiler``, 0-based steps) it
    profiles the steps it names: torchtitan logs step s (1-based) at its end, so that log ends 0-based step s - 1
    and begins step s."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.device = torch.device("cpu")  # train_here sets the trainer's device
        self.profiler: StepProfiler | None = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        allocated = hardware.peak_memory_gib(self.device)
        self.steps.append({"step": step, **metrics, "max_allocated_gib": allocated, "time": time.perf_counter()})
        if self.profiler is not None:
            self.profiler.after_step(step - 1)
            self.profiler.before_step(step)

    def close(self) -> None:
        pass


RECORDER = StepRecorder()


def build_recording_metrics(job_config: Any, parallel_dims: Any, model_args: Any = None, tag: str | None = None):
    """TrainSpec.build_metrics_processor_fn: torchtitan's own MetricsProcessor, its logger (TensorBoard / W&B, or the
    no-op one) and ``RECORDER`` in a LoggerContainer."""
    from torchtitan.components.metrics import LoggerContainer, build_metrics_processor

    processor = build_metrics_processor(job_config, parallel_dims, model_args, tag)
    loggers = LoggerContainer()
    loggers.add_logger(processor.logger)
    loggers.add_logger(RECORDER)
    processor.logger = loggers
    return processor


def register_spec() -> None:
    """``anytrain_llama3`` = llama3's TrainSpec with the added flavours, the random-token loader, no tokenizer, no
    validator and the recording metrics processor."""
    import dataclasses

    from torchtitan.models import llama3
    from torchtitan.protocols.train_spec import register_train_spec

    base = llama3.get_train_spec()
    spec = dataclasses.replace(
        base,
        model_args={**base.model_args, **titan_model_args()},
        build_dataloader_fn=build_random_loader,
        build_tokenizer_fn=None,
        build_validator_fn=None,
        build_metrics_processor_fn=build_recording_metrics,
    )
    register_train_spec(SPEC_NAME, spec)


def titan_argv(case: dict, warmup: int, steps: int, compile_model: bool, dump_folder: str) -> list[str]:
    """torchtitan CLI arguments (its 0.2.2 spelling) for a bench Case: shape, seq, micro-batch (local_batch_size) and
    global batch, fp32 parameters with bf16 autocast (its single-device mixed precision), the bench's optimizer
    settings, per-block + loss compile, FP8 through its float8 converter, and the Case's ``options`` (torchtitan's
    dotted JobConfig fields, e.g. ``activation_checkpoint.mode``; True = a flag)."""
    fields: dict[str, Any] = {
        "model.name": SPEC_NAME,
        "model.flavor": TORCHTITAN_FLAVOURS[case["flavour"]],
        "model.hf_assets_path": dump_folder,  # no tokenizer or checkpoint is read
        "job.dump_folder": dump_folder,
        "training.seq_len": case["seq"],
        "training.local_batch_size": case["micro"],
        "training.global_batch_size": case["global_batch"],
        "training.steps": warmup + steps,
        "training.dtype": "float32",
        "training.mixed_precision_param": "bfloat16",
        "training.max_norm": 1.0,
        "optimizer.lr": 4e-4,
        "optimizer.implementation": "fused",
        "lr_scheduler.warmup_steps": 100,
        "lr_scheduler.total_steps": 1000,
        "metrics.log_freq": 1,
        "metrics.disable_color_printing": True,
        "debug.seed": 0,  # a seeded init, as the anytrain rows have (debug.deterministic stays off)
    }
    if compile_model:
        fields["compile.enable"] = True
    precision = case.get("precision", "bf16")
    if precision.startswith("fp8-"):
        fields["model.converters"] = "quantize.linear.float8"
        fields["quantize.linear.float8.recipe_name"] = precision.removeprefix("fp8-")
        fields["quantize.linear.float8.filter_fqns"] = FP8_FILTER
    elif precision != "bf16":
        raise ValueError(f"precision {precision!r}: bf16 or fp8-<torchao recipe>")
    fields.update(case.get("options", {}))
    argv = []
    for key, value in fields.items():  # True: a flag
        argv += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    return argv


def summarise(recorded: list[dict], warmup: int, steps: int, started: float) -> dict:
    """The bench row's timing and memory fields from torchtitan's per-step metrics: the ``steps`` after ``warmup``."""
    warm, timed = recorded[:warmup], recorded[warmup : warmup + steps]
    if len(timed) != steps:
        raise RuntimeError(f"torchtitan logged {len(recorded)} steps, expected {warmup + steps}")
    return {
        "seconds": sum(s["time_metrics/end_to_end(s)"] for s in timed),  # its own step times (log_freq 1)
        "warmup_s": warm[-1]["time"] - started if warm else 0.0,
        "peak_mem_gib": max(s["max_allocated_gib"] for s in timed),
        "warmup_peak_mem_gib": max((s["max_allocated_gib"] for s in warm), default=0.0),
        "peak_reserved_gib": max(s["memory/max_reserved(GiB)"] for s in timed),
        "torchtitan_max_active_gib": max(s["memory/max_active(GiB)"] for s in timed),
        "torchtitan_tokens_per_s": [s["throughput(tps)"] for s in timed],
        "torchtitan_mfu_pct": [s["mfu(%)"] for s in timed],
        "losses": [s["loss_metrics/global_avg_loss"] for s in recorded[: warmup + steps]],
    }


def train_here(case: dict, warmup: int, steps: int, compile_model: bool, profile: bool = False) -> dict:
    """In the torchrun process: register the spec, parse the JobConfig, run torchtitan's Trainer; the row's fields.
    With ``profile`` one more step runs after the timed ones, under a kernel profile (``kernel_profile``)."""
    import torchtitan
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger
    from torchtitan.train import Trainer

    init_logger()
    RECORDER.device = bench_device()  # TF32 for fp32 matmuls outside autocast, as for every other row
    register_spec()
    row = {"torchtitan_version": torchtitan.__version__, "torchtitan_spec": SPEC_NAME}
    row.update(check_shapes(case["flavour"], titan_model_args()[TORCHTITAN_FLAVOURS[case["flavour"]]]))
    with tempfile.TemporaryDirectory(prefix="bench-torchtitan-") as dump_folder:
        argv = titan_argv(case, warmup, steps + int(profile), compile_model, dump_folder)
        if profile:
            RECORDER.profiler = StepProfiler(warmup + steps, 1, Path(dump_folder) / "profile", 0, RECORDER.device)
        row["torchtitan_args"] = " ".join(argv).replace(dump_folder, "<tmp>")
        config = ConfigManager().parse_args(argv)
        t0 = time.perf_counter()
        trainer = Trainer(config)
        row["trainer_init_s"] = time.perf_counter() - t0
        row["torchtitan_flops_per_token"] = trainer.metrics_processor.num_flops_per_token
        row["fp8_linears"] = sum(type(m).__name__ == "Float8Linear" for p in trainer.model_parts for m in p.modules())
        if case.get("precision", "bf16") != "bf16" and not row["fp8_linears"]:
            raise RuntimeError(f"precision {case['precision']}: torchtitan converted no layer to float8")
        try:
            started = time.perf_counter()
            trainer.train()
        finally:
            trainer.close()
    if case.get("precision", "bf16").startswith("fp8-"):
        import torchao

        row["torchao_version"] = torchao.__version__
    row.update(summarise(RECORDER.steps, warmup, steps, started))
    if RECORDER.profiler is not None and RECORDER.profiler.summary is not None:
        # step_wall_ms as the anytrain rows give it (the timed steps' mean); the profiled step's own in wall_ms
        wall_ms = 1e3 * row["seconds"] / steps
        row["kernel_profile"] = {**RECORDER.profiler.summary, "step_wall_ms": wall_ms}
    return row


def run_row(case: dict, warmup: int, steps: int, compile_model: bool = True, profile: bool = False) -> dict:
    """One torchtitan row for a bench Case (as a dict): ``torchrun --standalone --nproc_per_node 1`` of this module's
    trainer mode; the fields it printed, or ``{"error": ...}`` with the end of its output."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    trainer = ["-m", "bench.torchtitan_stack", "--in-trainer", json.dumps(case), "--warmup", str(warmup)]
    cmd = torchrun + trainer + ["--steps", str(steps)] + ([] if compile_model else ["--no-compile"])
    cmd += ["--profile"] if profile else []
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(ROW_MARK)]
    if not lines:
        return {"error": f"torchtitan exited {proc.returncode}: {proc.stdout[-1500:]}"}
    return json.loads(lines[-1][len(ROW_MARK) :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavour", default="llama-1b", choices=sorted(TORCHTITAN_FLAVOURS))
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=8, help="torchtitan's training.local_batch_size")
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--precision", default="bf16", help="bf16 | fp8-rowwise | fp8-tensorwise | ...")
    parser.add_argument(
        "--set", nargs="*", default=[], help="torchtitan JobConfig fields, KEY=VALUE (KEY alone: a flag)"
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--profile", action="store_true", help="a kernel profile of one more step after the timed ones")
    parser.add_argument("--in-trainer", default=None, help=argparse.SUPPRESS)  # the torchrun process: a Case as JSON
    args = parser.parse_args()
    if args.in_trainer is not None:
        try:
            row = train_here(json.loads(args.in_trainer), args.warmup, args.steps, not args.no_compile, args.profile)
        except Exception as exc:  # noqa: BLE001 - the row says what failed (OOM in one line)
            row = {"error": row_error(exc)}
        print_row(row)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        return
    options = dict(kv.split("=", 1) if "=" in kv else (kv, True) for kv in args.set)
    case = {
        "flavour": args.flavour,
        "seq": args.seq,
        "micro": args.micro,
        "global_batch": args.global_batch,
        "precision": args.precision,
        "options": options,
        "stack": "torchtitan",
    }
    row = {**case, **run_row(case, args.warmup, args.steps, not args.no_compile, args.profile)}
    if "seconds" in row:
        row["tokens_per_s"] = args.steps * args.global_batch * args.seq / row["seconds"]
    print(json.dumps(row, indent=1))
    print_row(row)


if __name__ == "__main__":
    main()
