"""Transformer training throughput on one GPU: HF transformers (eager, torch.compile) vs anytrain's recipe, and vs
the same HF model class trained by anytrain's trainer (``model.arch: hf``).

One run, one GPU, rows one after another, each in a fresh subprocess of this script with its own empty inductor cache
(``--in-process`` runs them in this process instead: measured on an H200, an HF + torch.compile row that follows
anytrain rows in the same process ran at ~40k instead of ~57k tokens/s, so sharing a process biases the comparison;
a shared compile cache let a row with another SDPA backend reuse the previous row's compiled graph, whose attention op
was chosen when it was traced), on identical random token batches
(a bank of 4 global batches drawn once from a seeded generator and cycled), with bf16 autocast, SDPA attention, fused
AdamW, gradient clipping and the same global batch / micro-batch / gradient accumulation per shape. A step is one
optimizer step (all micro-batches of the global batch); each row runs ``--warmup`` steps (compilation happens there)
then ``--steps`` timed steps between two device synchronisations. Peak memory is the caching allocator's max allocated
bytes over the timed steps (the previous row is garbage-collected and the peak counter reset before each row;
``warmup_peak_mem_gib`` covers the compile step).

The anytrain rows run the product's own code: the Trainer's build (train/build.py ``build_model``: meta-device build,
init, ``parallelize`` = ``train.compile``, ``build_optimizer``, autocast) and ``Trainer.train_step`` (micro-batch
loop, clipping, the per-step ``StepGuard`` agreement, optimizer and scheduler) on a Trainer whose data source yields
the random batches.

The ``anytrain-hf`` rows train HF's ``LlamaForCausalLM`` of the row's shape (the config the HF rows build, written to
a temporary folder as config.json, random init) through ``Trainer`` with ``model.arch: hf``: anytrain's fused linear +
CE, per-block (or whole-body) compile, fused AdamW and step machinery around transformers' own modules.

The ``torchtitan`` rows (``side_by_side_cases``: Llama-3.2-1B / 3B, bf16 and FP8) run torchtitan's own Trainer, its
llama3 model at anytrain's flavour's shape, on the same random batches, in a torchrun process of their own
(bench/torchtitan_stack.py; torchtitan and torchao are not dependencies: install them beside, e.g. ``pip install
--target``). Every row records ``stack`` and ``precision`` ("bf16", or "fp8-<torchao recipe>": ``train.fp8`` for
anytrain, torchao's float8 for HF, torchtitan's float8 converter).

MFU = (6·N_non-embedding + 12·L·d·T) × tokens/s / peak (989 TFLOP/s on H100/H200), the same formula for every row.

    PYTHONPATH=src python -m bench.transformer --out bench/results             # full table (GPU, needs transformers)
    PYTHONPATH=src python -m bench.transformer --groups 1.1b-2048 --profile    # one group, with a kernel profile
    PYTHONPATH=src python -m bench.transformer --smoke                         # CPU check of the anytrain path
    PYTHONPATH=src python -m bench.transformer --groups tiny-512 1.1b-2048-mb16 \
        --stacks anytrain-hf hf-compile anytrain                               # model.arch hf vs HF + compile
    PYTHONPATH=/tmp/site:src python -m bench.transformer --groups llama-1b-2048 llama-3b-2048   # vs torchtitan, HF fp8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from anytrain import hardware
from anytrain.config import ModelConfig, RunConfig
from anytrain.models import losses, resolve_args
from anytrain.models.llama import model as transformer
from anytrain.train.profiling import profile_call
from anytrain.train.trainer import Trainer
from bench import torchtitan_stack
from bench.common import RandomBatches, bench_device, child_env, release, results_path, row_error, versions


@dataclass
class Case:
    group: str  # rows of one group share shape, seq, micro-batch and global batch (the ratio is taken per group;
    # in the side-by-side groups each stack runs its own micro-batch: side_by_side_cases)
    flavour: str
    seq: int
    micro: int
    global_batch: int
    stack: str  # "hf-eager" | "hf-compile" | "anytrain" | "anytrain-hf" (HF's model class under model.arch hf)
    # | "torchtitan" (its own Trainer: bench/torchtitan_stack.py; options are its JobConfig fields)
    label: str = ""
    precision: str = "bf16"  # or "fp8-<torchao recipe>": train.fp8 / torchao float8 on HF / torchtitan's converter
    loss_impl: str = "chunked"
    native_gqa: bool | None = None  # None = the model's auto choice
    check_finite: bool = True
    attention: str = "auto"  # train.attention_backend for anytrain rows; the SDPA order for HF rows too
    profile: bool = False
    options: dict = field(default_factory=dict)  # dotted config overrides for anytrain rows, e.g. model.args.X
    ablation: bool = False  # a recipe change undone, for the one-change-at-a-time table (--ablations)
    wide_grads: bool = True  # transformer.WIDE_GRAD_LINEAR: fp32 weight gradients straight from the GEMMs


def default_cases(ablations: bool = False) -> list[Case]:
    """In priority order (a time budget drops the tail). Ablation rows (one recipe change undone each; their results
    are in docs/benchmarks.md) run only with ``ablations``."""
    big = dict(flavour="1.1b", seq=2048, micro=4, global_batch=32)  # micro-batch 4: the anchors' HF setup
    mb8 = dict(flavour="1.1b", seq=2048, micro=8, global_batch=32)  # configs/1.1b.yaml before it went to 16
    mb16 = dict(flavour="1.1b", seq=2048, micro=16, global_batch=32)  # configs/1.1b.yaml
    mb32 = dict(flavour="1.1b", seq=2048, micro=32, global_batch=32)  # no gradient accumulation (H200-sized memory)
    g, g8, g16, g32 = "1.1b-2048", "1.1b-2048-mb8", "1.1b-2048-mb16", "1.1b-2048-mb32"
    auto = {"train.compile_scope": "auto"}  # the recipe's: the whole body as one graph in a one-process run
    whole = {"train.compile_scope": "model"}  # the whole body as one compiled graph instead of per-block
    blocks = {"train.compile_scope": "blocks"}  # each block compiled on its own
    fp32_residual = {"model.args.residual_in_fp32": True}
    hf_fp32 = {**auto, **fp32_residual}
    graphs = {**auto, "train.cuda_graphs": 1}
    tiny = dict(flavour="tiny", seq=512, micro=32, global_batch=64)
    cases = [
        Case(g16, **mb16, stack="anytrain", label="anytrain recipe (configs/1.1b.yaml)", profile=True, options=auto),
        Case(g16, **mb16, stack="hf-compile", label="HF + torch.compile, mb 16", profile=True),
        Case(g16, **mb16, stack="anytrain-hf", label="model.arch hf, auto scope", profile=True, options=auto),
        Case(g16, **mb16, stack="anytrain-hf", label="model.arch hf, whole-body compile", options=whole, ablation=True),
        Case(
            g16,
            **mb16,
            stack="anytrain-hf",
            label="model.arch hf, fp32 residual stream",
            options=hf_fp32,
            ablation=True,
        ),
        Case("tiny-512", **tiny, stack="hf-compile", label="HF + torch.compile"),
        Case(
            "tiny-512", **tiny, stack="anytrain-hf", label="model.arch hf (HF Llama class)", options=auto, profile=True
        ),
        Case("tiny-512", **tiny, stack="anytrain-hf", label="model.arch hf, whole-body compile", options=whole),
        Case("tiny-512", **tiny, stack="anytrain-hf", label="model.arch hf + CUDA graphs", options=graphs),
        Case("tiny-512", **tiny, stack="anytrain", label="anytrain (compile_scope auto)", options=auto),
        Case("tiny-512", **tiny, stack="anytrain", label="anytrain + CUDA graphs", options=graphs),
        Case(g16, **mb16, stack="anytrain", label="anytrain + CUDA graphs", options={**auto, "train.cuda_graphs": 1}),
        Case(g16, **mb16, stack="anytrain", label="anytrain, per-block compile (the recipe before)", options=blocks),
        Case(g32, **mb32, stack="anytrain", label="anytrain micro-batch 32"),
        Case(g32, **mb32, stack="anytrain", label="anytrain mb 32, whole-model compile", options=whole),
        Case(g32, **mb32, stack="hf-compile", label="HF + torch.compile, mb 32"),
        Case(g8, **mb8, stack="anytrain", label="anytrain micro-batch 8"),
        Case(g, **big, stack="hf-eager", label="HF eager"),
        Case(g, **big, stack="hf-compile", label="HF + torch.compile"),
        Case(g, **big, stack="anytrain", label="anytrain, micro-batch 4"),
        Case(g8, **mb8, stack="hf-compile", label="HF + torch.compile, mb 8"),
        Case(
            g8,
            **mb8,
            stack="anytrain",
            label="anytrain mb 8, fp32 residual stream (before)",
            options=fp32_residual,
            ablation=True,
        ),
        Case(
            g,
            **big,
            stack="anytrain",
            label="anytrain mb 4, fp32 residual stream (before)",
            options=fp32_residual,
            ablation=True,
        ),
        Case("125m-2048", "125m", 2048, 8, 32, "anytrain", label="anytrain (compile_scope auto)", options=auto),
        Case("125m-2048", "125m", 2048, 8, 32, "hf-eager", label="HF eager"),
        Case("125m-2048", "125m", 2048, 8, 32, "hf-compile", label="HF + torch.compile"),
        Case("1.1b-4096", "1.1b", 4096, 2, 16, "anytrain", label="anytrain (compile_scope auto)", options=auto),
        Case("1.1b-4096", "1.1b", 4096, 2, 16, "hf-eager", label="HF eager"),
        Case("1.1b-4096", "1.1b", 4096, 2, 16, "hf-compile", label="HF + torch.compile"),
        Case("350m-2048", "350m", 2048, 8, 32, "anytrain", label="anytrain (compile_scope auto)", options=auto),
        Case("350m-2048", "350m", 2048, 8, 32, "hf-eager", label="HF eager"),
        Case("350m-2048", "350m", 2048, 8, 32, "hf-compile", label="HF + torch.compile"),
        Case(
            g,
            **big,
            stack="anytrain",
            label="anytrain before: full logits CE, K/V expanded",
            loss_impl="naive",
            native_gqa=False,
            ablation=True,
        ),
        Case(
            g,
            **big,
            stack="anytrain",
            label="anytrain + chunked linear+CE (K/V expanded)",
            native_gqa=False,
            ablation=True,
        ),
        Case(g, **big, stack="anytrain", label="anytrain, train.check_finite false", check_finite=False, ablation=True),
        Case(
            g8, **mb8, stack="anytrain", label="anytrain mb 8, cuDNN attention first", attention="cudnn", ablation=True
        ),
        Case(
            g16,
            **mb16,
            stack="anytrain",
            label="anytrain, autocast's bf16 weight gradients (before)",
            options=auto,
            wide_grads=False,
            ablation=True,
        ),
        Case(
            g16,
            **mb16,
            stack="anytrain",
            label="anytrain, FlashAttention-2 first (otherwise the recipe)",
            attention="flash",
            profile=True,  # the kernel table shows which attention kernels ran
            options=auto,
            ablation=True,
        ),
    ]
    cases += side_by_side_cases()
    return [c for c in cases if ablations or not c.ablation]


def side_by_side_cases() -> list[Case]:
    """anytrain vs torchtitan (its own Trainer) vs HF + torchao float8 + torch.compile at Llama-3.2-1B / 3B, bf16 and
    FP8 (tensorwise, the faster recipe, and rowwise, torchtitan's current one; the LM head and torchao's too-small
    GEMMs stay bf16 on every stack).
    Within a group: same seq, global batch and tokens per step; each stack at its own best settings, stated in the
    label and options: compile (anytrain: compile_scope auto; torchtitan: per block + loss), no activation
    checkpointing, and the largest micro-batch that leaves memory headroom on one H200 (torchtitan's and HF's loss
    keep full fp32 logits, anytrain's is chunked); where torchtitan's micro-batch is smaller, anytrain also at its
    micro-batch (equal memory footing)."""
    ours = {"train.compile_scope": "auto", "train.activation_checkpointing": "none"}
    theirs = {"activation_checkpoint.mode": "none"}  # with --compile.enable unless --no-compile
    cases, hf_cases = [], []  # the HF rows last: a time budget drops them first
    for flavour, global_batch, ours_mb, theirs_mb, hf_mb in (("llama-1b", 32, 16, 16, 8), ("llama-3b", 16, 8, 4, 4)):
        shape = dict(group=f"{flavour}-2048", flavour=flavour, seq=2048, global_batch=global_batch)
        for precision in ("bf16", "fp8-tensorwise", "fp8-rowwise"):
            row = dict(shape, precision=precision)
            ours_label = f"anytrain {precision}, compile auto, no AC"  # the micro-batch is a column of its own
            theirs_label = f"torchtitan {precision}, compile, no AC"
            cases.append(Case(**row, micro=ours_mb, stack="anytrain", options=ours, label=ours_label, profile=True))
            cases.append(
                Case(**row, micro=theirs_mb, stack="torchtitan", options=theirs, label=theirs_label, profile=True)
            )
            if theirs_mb != ours_mb:  # the same micro-batch as torchtitan's row: the equal-memory comparison
                label = f"{ours_label}, torchtitan's micro-batch"
                cases.append(Case(**row, micro=theirs_mb, stack="anytrain", options=ours, label=label, profile=True))
            if flavour == "llama-3b" and precision == "fp8-tensorwise":  # FP8's smaller activations fit the whole
                # global batch in one micro-batch on one H200 (bf16 does not): no accumulation
                label = f"{ours_label}, micro-batch {global_batch}"
                cases.append(Case(**row, micro=global_batch, stack="anytrain", options=ours, label=label))
        for precision in ("fp8-tensorwise", "fp8-rowwise"):
            hf = dict(micro=hf_mb, stack="hf-compile", precision=precision)
            hf_cases.append(Case(**shape, **hf, label=f"HF + torchao {precision} + compile"))
    # the 1.1B recipe's shape (configs/1.1b.yaml, micro-batch 16) in FP8, beside its bf16 row ("anytrain recipe"), and
    # HF + torchao float8 + compile at micro-batch 8 (the largest that leaves headroom with its fp32 logits)
    mb16 = dict(group="1.1b-2048-mb16", flavour="1.1b", seq=2048, micro=16, global_batch=32)
    mb8 = dict(group="1.1b-2048-mb8", flavour="1.1b", seq=2048, micro=8, global_batch=32)
    for precision in ("fp8-tensorwise", "fp8-rowwise"):
        label = f"anytrain {precision}, compile auto, no AC"
        cases.append(Case(**mb16, stack="anytrain", precision=precision, options=ours, label=label))
        hf_cases.append(
            Case(**mb8, stack="hf-compile", precision=precision, label=f"HF + torchao {precision} + compile")
        )
    return cases + hf_cases


def estimate_s(case: Case) -> float:
    """Rough wall time of a row on an H200 (start-up, compile, 1 + ``--steps`` steps), for the time budget: the rows'
    ``row_wall_s`` at the 1.1B / 1B shapes on 2026-12-02 (FP8 compiles longer: torchao's casts in every graph)."""
    scale = {"125m": 0.3, "350m": 0.6, "1.1b": 1.0, "tiny": 0.1, "debug": 0.01, "llama-1b": 1.0, "llama-3b": 1.6}
    stack = {"hf-compile": 110.0, "hf-eager": 25.0, "anytrain": 80.0, "anytrain-hf": 60.0, "torchtitan": 60.0}
    fp8 = {"hf-compile": 180.0, "anytrain": 135.0, "torchtitan": 80.0}
    base = fp8.get(case.stack, stack[case.stack]) if case.precision.startswith("fp8") else stack[case.stack]
    return base * scale.get(case.flavour, 1.0)


# ---------------------------------------------------------------------------------------------------------------------
# Batches and the two stacks


@contextlib.contextmanager
def model_switches(case: Case) -> Iterator[None]:
    saved = losses.LOSS_IMPL, transformer.SDPA_NATIVE_GQA, transformer.WIDE_GRAD_LINEAR
    losses.LOSS_IMPL, transformer.SDPA_NATIVE_GQA, transformer.WIDE_GRAD_LINEAR = (
        case.loss_impl,
        case.native_gqa,
        case.wide_grads,
    )
    try:
        yield
    finally:
        losses.LOSS_IMPL, transformer.SDPA_NATIVE_GQA, transformer.WIDE_GRAD_LINEAR = saved


@contextlib.contextmanager
def attention_order(case: Case) -> Iterator[None]:
    """The row's SDPA kernel order (hardware.set_attention_backend), restored afterwards for the next row."""
    names = ("flash", "cudnn", "mem_efficient")
    hardware.settle_sdpa_order()  # PyTorch's own default, as later rows in this process would see it
    flags = {n: getattr(torch._C, f"_get_{n}_sdp_enabled")() for n in names}
    getter = getattr(torch._C, "_get_sdp_priority_order", None)
    order = getter() if getter else None
    hardware.set_attention_backend(case.attention)
    try:
        yield
    finally:
        for n, on in flags.items():
            getattr(torch._C, f"_set_sdp_use_{n}")(on)
        if order is not None:
            torch._C._set_sdp_priority_order(order)


def anytrain_step_fn(case: Case, device: torch.device, batches: RandomBatches, compile_blocks: bool) -> tuple:
    """A Trainer without data files or a run dir: the product's build and train_step on random batches."""
    cfg = RunConfig()
    model_args = {k.removeprefix("model.args."): v for k, v in case.options.items() if k.startswith("model.args.")}
    cfg.model = ModelConfig(arch="transformer", flavour=case.flavour, args=model_args)
    if case.stack == "anytrain-hf":  # HF's class of this shape, trained by the Trainer: only config.json is needed
        folder = tempfile.mkdtemp(prefix="bench-hf-")
        hf_llama_config(case.flavour).save_pretrained(folder)
        cfg.model = ModelConfig(arch="hf", hf_path=folder, args={"init": "random", **model_args})
    cfg.data.seq_len = case.seq
    cfg.train.global_batch, cfg.train.micro_batch = case.global_batch, case.micro
    cfg.train.compile, cfg.train.check_finite = compile_blocks, case.check_finite
    cfg.train.attention_backend = case.attention
    cfg.train.lr, cfg.train.warmup_steps, cfg.train.steps = 4e-4, 100, 1000
    if case.precision != "bf16":  # "fp8-<recipe>": anytrain's FP8 training (train.fp8)
        cfg.train.fp8 = case.precision.removeprefix("fp8-")
    for key, value in case.options.items():  # train.X overrides (model.args.X went into the ModelConfig above)
        if key.startswith("train."):
            setattr(cfg.train, key.removeprefix("train."), value)
    with model_switches(case):
        trainer = Trainer(cfg, batches=batches)  # no run directory: nothing is written
    model = trainer.raw_model
    info = {"params": model.num_params(), "flops_per_token": model.flops_per_token(case.seq)}
    info["fp8_linears"] = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    if case.precision != "bf16" and not info["fp8_linears"]:
        raise RuntimeError(f"precision {case.precision}: no layer was converted (does this anytrain have train.fp8?)")

    def step(i: int) -> None:
        with model_switches(case):  # the loss implementation is read at call time
            trainer.train_step(i)

    return step, info, trainer


def hf_llama_config(flavour: str):
    """HF LlamaConfig of anytrain's Transformer flavour (SDPA attention, the head tied as the flavour's, no KV
    cache)."""
    from transformers import LlamaConfig

    a = resolve_args(ModelConfig(arch="transformer", flavour=flavour))
    return LlamaConfig(
        vocab_size=a.vocab_size,
        hidden_size=a.dim,
        intermediate_size=a.ffn_dim,
        num_hidden_layers=a.n_layers,
        num_attention_heads=a.n_heads,
        num_key_value_heads=a.n_kv_heads,
        max_position_embeddings=a.max_seq_len,
        rms_norm_eps=a.norm_eps,
        tie_word_embeddings=a.tie_embeddings,
        use_cache=False,
        attn_implementation="sdpa",
    )


def hf_float8(model: torch.nn.Module, recipe: str) -> dict:
    """torchao's float8 training on an HF model, as torchao documents it: ``convert_to_float8_training`` with the
    recipe's config and torchao's auto-filter (its too-small GEMMs stay high precision), the LM head left out."""
    import torchao
    from torchao.float8 import Float8LinearConfig, _auto_filter_for_recipe, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    keep = _auto_filter_for_recipe(recipe, filter_fqns=["lm_head"])
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=keep)
    converted = sum(isinstance(m, Float8Linear) for m in model.modules())
    return {"torchao_version": torchao.__version__, "fp8_linears": converted}


def hf_step_fn(case: Case, device: torch.device, batches: RandomBatches) -> tuple:
    """HF LlamaForCausalLM of the same shape (random init, fp32 master weights), autocast bf16, SDPA, fused AdamW."""
    from transformers import LlamaForCausalLM

    config = hf_llama_config(case.flavour)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model = model.float().train()
    params = sum(p.numel() for p in model.parameters())
    info = {"params": params, "attn_implementation": getattr(model.config, "_attn_implementation", None)}
    if case.precision != "bf16":
        info.update(hf_float8(model, case.precision.removeprefix("fp8-")))
    optimizer = torch.optim.AdamW(model.parameters(), lr=4e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    run = torch.compile(model) if case.stack == "hf-compile" else model
    accum = case.global_batch // case.micro

    def step(i: int) -> None:
        inputs, _, _ = batches.rank_batch(i)
        inputs = inputs.to(device, non_blocking=True)
        for k in range(accum):
            x = inputs[k * case.micro : (k + 1) * case.micro]
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = run(input_ids=x, labels=x).loss / accum  # HF shifts the labels itself
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, info, (model, optimizer, run)


# ---------------------------------------------------------------------------------------------------------------------
# Measuring


def measure(step: Callable[[int], None], device: torch.device, warmup: int, steps: int) -> dict:
    started = time.perf_counter()
    for i in range(warmup):
        step(i)
    hardware.synchronize(device)
    warmup_s = time.perf_counter() - started
    warm_peak = hardware.peak_memory_gib(device)
    hardware.reset_peak_memory(device)
    t0 = time.perf_counter()
    for i in range(steps):
        step(warmup + i)
    hardware.synchronize(device)
    return {
        "seconds": time.perf_counter() - t0,
        "warmup_s": warmup_s,
        "peak_mem_gib": hardware.peak_memory_gib(device),
        "warmup_peak_mem_gib": warm_peak,
        "peak_reserved_gib": hardware.peak_memory_gib(device, reserved=True),
    }


def run_case(case: Case, device: torch.device, args: argparse.Namespace) -> dict:
    vocab = resolve_args(ModelConfig(arch="transformer", flavour=case.flavour)).vocab_size
    batches = RandomBatches(vocab, case.global_batch, case.seq)
    row = {**asdict(case), "tokens_per_step": case.global_batch * case.seq}
    holder = None
    try:
        if case.stack == "torchtitan":  # its own Trainer in a torchrun process of its own (bench/torchtitan_stack.py)
            profile = case.profile and args.profile  # one step after the timed ones, in torchtitan's process
            row.update(torchtitan_stack.run_row(asdict(case), args.warmup, args.steps, not args.no_compile, profile))
            if "seconds" in row:
                row["tokens_per_s"] = args.steps * row["tokens_per_step"] / row["seconds"]
            return row
        with attention_order(case):
            if case.stack in ("anytrain", "anytrain-hf"):
                step, info, holder = anytrain_step_fn(case, device, batches, compile_blocks=not args.no_compile)
            else:
                step, info, holder = hf_step_fn(case, device, batches)
            row.update(info)
            row.update(measure(step, device, args.warmup, args.steps))
            if case.options.get("train.cuda_graphs"):  # activations in the graph's pool: not in the allocated peak
                row["peak_mem_gib"], row["peak_mem_kind"] = row["peak_reserved_gib"], "reserved"
            row["tokens_per_s"] = args.steps * row["tokens_per_step"] / row["seconds"]
            if case.profile and args.profile:
                wall = row["seconds"] / args.steps
                index = args.warmup + args.steps
                row["kernel_profile"] = {"step_wall_ms": 1e3 * wall, **profile_call(lambda: step(index), device)}
    except Exception as exc:  # noqa: BLE001 - one failing row must not lose the others
        row["error"] = row_error(exc)
    finally:
        del holder
    return row


def finish_rows(rows: list[dict], peak: float | None) -> None:
    """MFU with anytrain's flops/token of the shape; ratio of each row to the best HF row and to the best torchtitan
    row of the same shape, sequence length and precision at any micro-batch (groups "<shape>-<seq>" and
    "<shape>-<seq>-mb<k>")."""
    flops = {(r["flavour"], r["seq"]): r["flops_per_token"] for r in rows if "flops_per_token" in r}
    for r in rows:
        fpt = flops.get((r["flavour"], r["seq"]))
        if fpt is None and "error" not in r:
            with torch.device("meta"):
                fpt = transformer.Transformer(resolve_args(ModelConfig(flavour=r["flavour"]))).flops_per_token(r["seq"])
        r["flops_per_token"] = fpt
        r["mfu"] = fpt * r["tokens_per_s"] / peak if peak and "tokens_per_s" in r else None

    def kind(x: dict) -> tuple[str, str]:  # the shape-seq group at any micro-batch, and the precision
        return x["group"].split("-mb")[0], x.get("precision", "bf16")

    def ratio_to_best(r: dict, stack: str) -> float | None:
        peers = [x for x in rows if x["stack"].startswith(stack) and "tokens_per_s" in x and kind(x) == kind(r)]
        best = max((x["tokens_per_s"] for x in peers), default=None)
        return r["tokens_per_s"] / best if best and "tokens_per_s" in r else None

    for r in rows:
        r["ratio_vs_best_hf"], r["ratio_vs_torchtitan"] = ratio_to_best(r, "hf"), ratio_to_best(r, "torchtitan")


def print_table(rows: list[dict]) -> None:
    head = f"{'group':<16}{'row':<48}{'mb':>4}{'tokens/s':>11}{'MFU':>8}{'peak GiB':>10}{'vs best HF':>12}"
    head += f"{'vs titan':>10}"  # vs the best torchtitan row of the shape and precision
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        if "tokens_per_s" not in r:
            print(f"{r['group']:<16}{r['label']:<48}{r['micro']:>4}  {r.get('error', 'skipped')[:90]}")
            continue
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        ratio = "" if r["ratio_vs_best_hf"] is None else f"{r['ratio_vs_best_hf']:.2f}x"
        titan = "" if r["ratio_vs_torchtitan"] is None else f"{r['ratio_vs_torchtitan']:.2f}x"
        print(
            f"{r['group']:<16}{r['label'][:47]:<48}{r['micro']:>4}{r['tokens_per_s']:>11,.0f}{mfu:>8}"
            f"{r['peak_mem_gib']:>10.1f}{ratio:>12}{titan:>10}"
        )
    for r in rows:
        if "kernel_profile" in r:
            p = r["kernel_profile"]
            print(
                f"\nprofile of one step of '{r['group']} {r['label']}': wall {p['step_wall_ms']:.0f} ms, "
                f"kernels {p['kernel_ms']:.0f} ms"
            )
            for kind, v in p["kinds"].items():
                print(f"  {kind:<40}{v['ms']:>9.1f} ms {100 * v['share']:>5.1f}%")
            for k in p["top"]:
                print(f"  {k['ms']:>9.1f} ms {100 * k['share']:>5.1f}% x{k['calls']:<5} {k['kernel']}")


def run_case_here(case: Case, device: torch.device, args: argparse.Namespace) -> dict:
    release(device)
    start_gib = torch.cuda.memory_allocated(device) / 2**30 if hardware.is_gpu(device) else 0.0
    row = run_case(case, device, args)
    row["allocated_at_start_gib"] = start_gib  # ~0: nothing left over from earlier rows
    return row


ROW_MARK = "ROW-JSON "


def run_case_child(case: Case) -> dict:
    """Run one case in a fresh Python process (same flags as this one) and return its row."""
    argv = [a for a in sys.argv[1:] if a != "--in-process"]
    cmd = [sys.executable, "-m", "bench.transformer", *argv, "--one-case", json.dumps(asdict(case))]
    # a cache of its own: inductor's graph cache key does not cover the SDPA backend flags, so a row that only changes
    # the attention backend would otherwise replay the previous row's graph (seen: a 5.7 s "compile", same memory)
    with tempfile.TemporaryDirectory(prefix="anytrain-bench-inductor-") as cache:
        env = child_env(TORCHINDUCTOR_CACHE_DIR=cache)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(ROW_MARK)]
    if not lines:
        return {**asdict(case), "error": f"child exited {proc.returncode}: {proc.stdout[-600:]}"}
    return json.loads(lines[-1][len(ROW_MARK) :])


def run_child(args: argparse.Namespace) -> None:
    case = Case(**json.loads(args.one_case))
    if args.smoke:
        args.steps, args.warmup, args.no_compile = 2, 1, True
    device = bench_device(args.smoke)
    print(ROW_MARK + json.dumps(run_case_here(case, device, args), default=str), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results", help="directory for transformer_<device>.json")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per row")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (compilation happens here)")
    parser.add_argument("--groups", nargs="*", default=None, help="only these groups (e.g. 1.1b-2048 125m-2048)")
    parser.add_argument("--stacks", nargs="*", default=None, help="only these stacks (e.g. anytrain torchtitan)")
    parser.add_argument("--budget-s", type=float, default=0.0, help="skip rows that would end past this (0 = none)")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--no-compile", action="store_true", help="anytrain rows without per-block compile")
    parser.add_argument("--match", nargs="*", default=None, help="only rows whose label contains one of these")
    parser.add_argument("--exclude", nargs="*", default=None, help="drop rows whose label contains one of these")
    parser.add_argument("--ablations", action="store_true", help="also the rows that undo one recipe change each")
    parser.add_argument("--smoke", action="store_true", help="CPU check: debug shape, anytrain rows only, 2 steps")
    parser.add_argument("--in-process", action="store_true", help="run every row in this process (no subprocess)")
    parser.add_argument("--one-case", default=None, help=argparse.SUPPRESS)  # a child: run this JSON Case, print row
    args = parser.parse_args()
    if args.one_case is not None:
        run_child(args)
        return
    device = bench_device(args.smoke)
    if args.smoke:
        cases = [
            Case("debug", "debug", 64, 2, 4, "anytrain", label="anytrain"),
            Case("debug", "debug", 64, 2, 4, "anytrain", label="naive loss", loss_impl="naive", native_gqa=False),
            Case("debug", "debug", 64, 2, 4, "anytrain-hf", label="model.arch hf (HF Llama class)"),
        ]
        args.steps, args.warmup, args.no_compile = 2, 1, True
    else:
        cases = [
            c
            for c in default_cases(args.ablations)
            if (args.groups is None or c.group in args.groups)
            and (args.stacks is None or c.stack in args.stacks)
            and (args.match is None or any(m in c.label for m in args.match))
            and not any(m in c.label for m in args.exclude or ())
        ]
    env = versions(device)
    out_path = results_path(args.out, "transformer", env, args.smoke)
    print(json.dumps(env), flush=True)
    started, rows = time.perf_counter(), []
    for case in cases:
        elapsed = time.perf_counter() - started
        if args.budget_s and elapsed + estimate_s(case) > args.budget_s:
            rows.append({**asdict(case), "error": f"skipped: time budget ({elapsed:.0f} s used)"})
            continue
        t0 = time.perf_counter()
        rows.append(run_case_here(case, device, args) if args.in_process else run_case_child(case))
        rows[-1]["row_wall_s"] = time.perf_counter() - t0
        shown = {k: v for k, v in rows[-1].items() if k not in ("kernel_profile", "options")}
        print(json.dumps(shown, default=str), flush=True)
        finish_rows(rows, hardware.peak_flops(device))
        payload = {
            "date": time.strftime("%Y-%m-%d"),
            "device": env["device"],
            "versions": env,
            "settings": {
                "steps": args.steps,
                "warmup": args.warmup,
                "dtype": "bf16 autocast (fp32 on CPU)",
                "env": {k: v for k, v in os.environ.items() if k.startswith(("ANYTRAIN", "TORCH"))},
            },
            "rows": rows,
        }
        out_path.write_text(json.dumps(payload, indent=1, default=str))
    finish_rows(rows, hardware.peak_flops(device))
    print_table(rows)
    print(f"\nwrote {out_path}")


if __name__ == "__main__":
    main()
