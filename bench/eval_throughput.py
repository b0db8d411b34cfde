"""Eval throughput on an exported checkpoint (issue #37's GPU check): train, export to Hugging Face, generate with
transformers, and score one multiple-choice task with anytrain's native scorer, the lm-evaluation-harness bridge and
lm-eval's own ``HFLM`` on the export, in one run.

For each recipe (default ``configs/1.1b.yaml:100`` and ``configs/mamba-1.4b.yaml:100``, ``RECIPE:STEPS``), one after
the other:

1. ``train``: ``python -m anytrain train RECIPE --run-dir W/run`` for ``--steps`` steps at ``--global-batch`` (8) and
   ``--seq-len`` (2048) on the prepared ``--data`` (default ``data/shakespeare``, ``make data`` / ``anytrain prepare
   shakespeare``); the final checkpoint only, no checksums. ``--compile auto`` (default): the 1.1B keeps its recipe's
   torch.compile (whole model, ~60-75 s of compile on an H100) at micro-batch 8, measured at 39.5 GiB peak (59.5 at
   the recipe's 16) — eager at micro-batch 8 it ran out of memory on an H100 80GB; Mamba trains eagerly at
   micro-batch 4 (150 steps in 138 s on an H100; the compiled recipe needs 72.7 GiB at 8 and minutes of compile).
   ``--compile recipe``: every recipe keeps its compile; ``--compile off``: all eager, micro-batch at most 4.
2. ``export``: ``python -m anytrain export W/run --format hf --out W/hf --dtype bf16`` (fp32 with ``--smoke``).
3. ``eval`` (a fresh child process: ``--eval-child``), every model on the same device, batch size ``--batch-size``
   for all three stacks:

   * ``generate``: ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained(W/hf)`` in bf16 (fp32 on CPU), greedy
     ``generate`` of ``--max-new-tokens`` tokens (forced: ``min_new_tokens``) after ``<|endoftext|>`` + ``--prompt``
     (one untimed warm-up generation first): the text, tokens/s, and the greedy text of anytrain's own model
     (``Scorer.generate_until``) for comparison;
   * ``native``: ``evals.tasks.score_task`` (what ``anytrain eval RUN --tasks FILE.jsonl`` runs) with the run's
     checkpoint loaded by ``scorer_for_run``; timed: the scoring of the whole task only (model load and one untimed
     warm-up pass over ``--warmup-items`` items excluded; the load is recorded as ``load_s``);
   * ``bridge``: ``evals.lm_eval_bridge.run_lm_eval`` (``anytrain eval RUN --lm-eval TASK --include-path DIR``: the
     ``anytrain`` lm-eval model over the same scorer object); timed: the whole ``simple_evaluate`` (lm-eval's task
     build from its dataset cache, requests, model calls, metrics) after an untimed warm-up call with ``--limit``;
   * ``hflm``: ``lm_eval.models.huggingface.HFLM`` over the transformers model loaded above (tokenizer from W/hf,
     ``add_bos_token=True`` so that every sequence starts with ``<|endoftext|>`` as in the native scorer,
     ``softmax_dtype=float32`` as the native scorer's log-softmax), timed the same way as ``bridge``.

   ``model_s`` is the time spent inside the model's ``loglikelihood`` (for ``native``: the whole timed call).
   ``examples_per_s`` = items scored / timed seconds; ``requests_per_s`` = scored (context, choice) pairs / seconds.
   ``--stack-items STACK[@ARCH]=N``: that stack scores only the task's first N items (lm-eval's ``--limit``; the
   row's ``item_limit``), and the native row adds acc / acc_norm over the same items (``first``). Default
   ``hflm@mamba=64``: transformers' Mamba without ``mamba_ssm`` / ``causal_conv1d`` runs a PyTorch scan (a Python loop
   over the tokens in every layer; 14.4 tokens/s generating with mamba-1.4b on an H100), and HFLM's 500 items did not
   finish in the 170 s the budget had left; the bridge and native rows score all items (anytrain's model).
   All three rows normalise ``acc_norm`` as lm-eval (characters of the choice), so equal log-likelihoods give equal
   ``acc`` and ``acc_norm``.

The task: ``--items`` items (default 500) with ``--choices`` choices each, built deterministically (seed 1234) from
the prepared data's validation text (then its training text when that is too short): the context is
``--context-words`` consecutive words, the correct choice the next ``--choice-words`` words, the distractors
``--choice-words`` words from random other places. It is written as an anytrain ``mc`` JSONL file plus an lm-eval
task YAML over the same file (``--include-path``).

Results: ``bench/results/eval_throughput_<device>.json`` (``--smoke``: not there) and, with ``--out DIR``, a copy in
``DIR`` with the stage logs under ``DIR/eval_throughput_logs/``; a table per recipe as it finishes and one of all at
the end: recipe, stack, items, examples/s, ratio against HFLM, acc, acc_norm. Every stage prints its wall time.
Partial results: ``eval_throughput.partial.json`` (in ``--out``, else the results folder) is rewritten after every
stage with the rows so far (``"complete": false``) and removed when the final file is written; the eval child writes
its row after generation and after each stack to ``eval_throughput_logs/<recipe>_eval_row.json``. ``--budget-s``
(450): a recipe that would start after that many seconds is skipped, and a stage running past it is killed (an
error row that keeps the stacks that finished; the others kept).

Default plan on one H100 (estimated from the parts measured there; ~6.5 minutes, ~7 with eval_check.sh's setup):
1.1B train ~100 s (compile ~60-75 s, 100 steps at ~70k tokens/s), export ~20 s, eval ~45 s; mamba-1.4b train
~100 s, export ~27 s, eval ~90 s (loads, generation, native 12 s for 500 items, bridge, HFLM on 64 items).

    PYTHONPATH=src python bench/eval_throughput.py --out /tmp/eval                # GPU: both recipes (~6.5 minutes)
    PYTHONPATH=src python bench/eval_throughput.py configs/1.1b.yaml:100 --items 200   # RECIPE[:STEPS]
    PYTHONPATH=src python bench/eval_throughput.py --smoke --out /tmp/eval         # CPU check: tiny recipes, 2 steps

``bash bench/device/eval_check.sh`` is the one-call GPU command (wheels, corpus, this bench). Needs transformers and
lm-eval (``pip install 'anytrain[hf,eval]'``); offline: ``HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from anytrain.evals.lm_eval_bridge import write_local_task  # noqa: E402 (imports no lm-eval: a YAML writer)

RECIPES = ["configs/1.1b.yaml:100", "configs/mamba-1.4b.yaml:100"]
SMOKE_RECIPES = ["configs/tiny.yaml", "configs/tiny-mamba.yaml"]
STACKS = ["native", "bridge", "hflm"]
# HFLM over transformers' MambaForCausalLM: without mamba_ssm and causal_conv1d transformers runs its PyTorch scan, a
# Python loop over the tokens in each of the 48 layers; 500 items did not finish in the time left (> 170 s, H100)
STACK_ITEMS = ["hflm@mamba=64"]
PARTIAL = "eval_throughput.partial.json"  # not eval_throughput_<device>.json
TASK = "anytrain_corpus_mc"
SEED = 1234


def log(message: str) -> None:
    print(f"[eval_throughput] {message}", flush=True)


# --------------------------------------------------------------------------------------------------------------------
# the task


def corpus_words(data_dir: Path, need: int) -> list[str]:
    """Whitespace-separated words of the prepared dataset's validation documents, then of its training documents,
    until ``need`` words (each document decoded on its own, in storage order)."""
    import numpy as np

    from anytrain.data.prepare import load_tokenizer
    from anytrain.data.shards import TokenDataset

    dataset = TokenDataset(data_dir)
    tokenizer = load_tokenizer(dataset.tokenizer_path)
    words: list[str] = []
    for split in ("val", "train"):
        if not dataset.index["splits"].get(split):
            continue
        for array in dataset.split(split).arrays:
            for start in range(0, array.size, 1 << 20):
                chunk = np.asarray(array[start : start + (1 << 20)], dtype=np.int64)
                for doc in np.split(chunk, np.flatnonzero(chunk == dataset.eos_id)):
                    words.extend(tokenizer.decode([int(t) for t in doc if t != dataset.eos_id]).split())
                if len(words) >= need:
                    return words
    return words


def build_task(data_dir: Path, out_dir: Path, items: int, choices: int, context_words: int, choice_words: int,
               seed: int = SEED) -> dict:  # fmt: skip
    """Write ``out_dir/TASK.jsonl`` (anytrain's mc schema) and ``out_dir/TASK.yaml`` (lm-eval, over that file):
    ``items`` non-overlapping windows of the corpus, each a context of ``context_words`` words and the next
    ``choice_words`` words as the correct choice among ``choices`` (distractors: spans from random other places)."""
    span = context_words + choice_words
    words = corpus_words(data_dir, items * span + span)
    slots = (len(words) - choice_words) // span
    if slots < items or slots < 2:
        raise SystemExit(f"error: {data_dir} has {len(words)} words: too few for {items} items of {span} words")
    rng = random.Random(seed)
    records = []
    for slot in sorted(rng.sample(range(slots), items)):
        at = slot * span
        context = " ".join(words[at : at + context_words])
        correct = " ".join(words[at + context_words : at + span])
        options = [correct]
        while len(options) < choices:
            other = rng.randrange(0, len(words) - choice_words)
            text = " ".join(words[other : other + choice_words])
            if abs(other - (at + context_words)) >= choice_words and text not in options:
                options.append(text)
        label = rng.randrange(choices)
        options[0], options[label] = options[label], options[0]
        records.append({"context": context, "choices": options, "label": label})
    out_dir.mkdir(parents=True, exist_ok=True)
    jsonl = out_dir / f"{TASK}.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    write_local_task(TASK, jsonl, out_dir)
    return {"file": str(jsonl), "items": items, "choices": choices, "context_words": context_words,
            "choice_words": choice_words, "seed": seed, "corpus_words": len(words)}  # fmt: skip


# --------------------------------------------------------------------------------------------------------------------
# the eval stage (in a fresh process on GPUs; in this one with --smoke)


def _sync(device) -> None:
    from anytrain import hardware

    hardware.synchronize(device)


def _free(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Timer:
    """Accumulated seconds and calls of a wrapped function (the model's loglikelihood); ``last``: its last result."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds, self.calls, self.last = fn, 0.0, 0, None

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            self.last = self.fn(*args, **kwargs)
            return self.last
        finally:
            self.seconds += time.perf_counter() - started
            self.calls += 1


def generate_row(hf_dir: Path, spec: dict, device, dtype) -> tuple[dict, object, object]:
    """Load the export with transformers, greedy-generate; (row, model, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
    _sync(device)
    row = {"load_s": time.perf_counter() - started, "class": type(model).__name__, "dtype": str(dtype),
           "params": sum(p.numel() for p in model.parameters())}  # fmt: skip
    eos = tokenizer.eos_token_id
    ids = torch.tensor([[eos] + tokenizer(spec["prompt"], add_special_tokens=False).input_ids], device=device)
    new = spec["max_new_tokens"]

    def generate(n: int):
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=tokenizer.pad_token_id or eos)  # fmt: skip

    generate(min(4, new))  # warm-up: first kernels, caches
    _sync(device)
    started = time.perf_counter()
    out = generate(new)
    _sync(device)
    seconds = time.perf_counter() - started
    tokens = out[0, ids.shape[1] :].tolist()
    row.update(prompt=spec["prompt"], new_tokens=len(tokens), seconds=seconds, tokens_per_s=len(tokens) / seconds,
               text=tokenizer.decode(tokens, skip_special_tokens=True), token_ids=tokens)  # fmt: skip
    return row, model, tokenizer


def native_row(scorer, task_file: Path, spec: dict, device) -> dict:
    """``score_task`` timed over the whole task; ``first``: acc / acc_norm over the first N items for each item limit
    of another stack (``--stack-items``), from the same scores (lm-eval's ``--limit N`` scores the first N items)."""
    import numpy as np

    from anytrain.evals.tasks import load_task, norm_scores, score_task

    task = load_task(task_file)
    if spec["warmup_items"]:
        score_task(scorer, task, limit=spec["warmup_items"])
    timer = Timer(scorer.loglikelihood)
    scorer.loglikelihood = timer
    try:
        _sync(device)
        started = time.perf_counter()
        metrics = score_task(scorer, task)
        _sync(device)
        seconds = time.perf_counter() - started
    finally:
        del scorer.loglikelihood  # the class's method again
    requests = sum(len(item.continuations) for item in task.items)
    scores, right, right_norm = iter(timer.last), [], []
    for item in task.items:  # per item, as score_task decides (acc_norm: lm-eval's len(choice) normalisation)
        lls = [next(scores)[0] for _ in item.continuations]
        right.append(int(np.argmax(lls)) == item.label)
        right_norm.append(int(np.argmax(norm_scores(lls, item.choices))) == item.label)
    first = {str(n): {"acc": sum(right[:n]) / n, "acc_norm": sum(right_norm[:n]) / n}
             for n in sorted(set(spec.get("prefixes", []))) if 0 < n < len(task.items)}  # fmt: skip
    return {"acc": metrics["acc"], "acc_norm": metrics["acc_norm"], "n": metrics["n"], "seconds": seconds,
            "model_s": timer.seconds, "requests": requests, "timed": "evals.tasks.score_task (model loaded)",
            **({"first": first} if first else {})}  # fmt: skip


def lm_eval_row(evaluate, model_timer: Timer, task, limit: int, spec: dict, device) -> dict:
    """``evaluate(limit)`` -> {metric: value}: an untimed warm-up with ``--warmup-items``, then the task's first
    ``limit`` items (0: all) timed."""
    items = task.items[:limit] if limit else task.items
    if spec["warmup_items"]:
        evaluate(min(spec["warmup_items"], len(items)))
    model_timer.seconds = 0.0
    _sync(device)
    started = time.perf_counter()
    metrics = evaluate(limit if limit < len(task.items) else 0)
    _sync(device)
    seconds = time.perf_counter() - started
    return {"acc": metrics["acc"], "acc_norm": metrics["acc_norm"], "n": metrics.get("n") or len(items),
            "seconds": seconds, "model_s": model_timer.seconds,
            "requests": sum(len(item.continuations) for item in items),
            "timed": "lm_eval.simple_evaluate (model loaded)",
            **({"item_limit": limit} if 0 < limit < len(task.items) else {})}  # fmt: skip


def hflm_evaluate(lm, include_path: Path, limit: int) -> dict:
    """lm-eval's simple_evaluate of the task on an lm-eval model, as ``run_lm_eval`` calls it for the bridge."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(include_path), include_defaults=False)
    results = lm_eval.simple_evaluate(model=lm, tasks=[TASK], num_fewshot=0, limit=limit or None,
                                      task_manager=manager, random_seed=SEED, numpy_random_seed=SEED,
                                      torch_random_seed=SEED, fewshot_random_seed=SEED)  # fmt: skip
    metrics = results["results"][TASK]
    kept = {k.split(",")[0]: v for k, v in metrics.items() if isinstance(v, int | float) and "stderr" not in k}
    kept["n"] = kept.pop("sample_len", None)
    return kept


def _quiet_lm_eval() -> None:
    import logging

    for name in ("lm_eval", "lm-eval", "datasets", "transformers", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


def eval_stage(spec: dict) -> dict:
    """Generation and the three stacks' scoring of one recipe's run / export (``spec``: paths and options). The row
    so far is written to ``spec["row_file"]`` after generation and after each stack, so that a stage killed at the
    budget's end keeps what finished."""
    import torch

    from anytrain import hardware
    from anytrain.evals.lm_eval_bridge import run_lm_eval
    from anytrain.evals.tasks import load_task, scorer_for_run

    _quiet_lm_eval()
    device = hardware.resolve_device(spec["device"])
    gpu = hardware.is_gpu(device)
    dtype = torch.bfloat16 if gpu and hardware.supports_bf16(device) else torch.float32
    run_dir, hf_dir, task_file = Path(spec["run_dir"]), Path(spec["hf_dir"]), Path(spec["task_file"])
    include_path = task_file.parent
    task = load_task(task_file)
    limits = {stack: n for stack, n in spec.get("stack_items", {}).items() if 0 < n < len(task.items)}
    out: dict = {"device": hardware.device_name(device), "batch_size": spec["batch_size"], "stacks": {}}
    stacks = out["stacks"]
    model = tokenizer = scorer = None
    row_file = Path(spec["row_file"]) if spec.get("row_file") else None

    def save() -> None:  # whole or not at all: a kill during the write leaves the previous row
        if row_file is not None:
            temp = row_file.with_suffix(".tmp")
            temp.write_text(json.dumps(out, default=str))
            os.replace(temp, row_file)

    def attempt(name: str, fn) -> None:
        started = time.perf_counter()
        try:
            stacks[name] = fn()
        except Exception as exc:  # noqa: BLE001 - one failing stack must not lose the others
            import traceback

            traceback.print_exc()
            stacks[name] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
        row = stacks[name]
        if "seconds" in row:
            row["examples_per_s"] = row["n"] / row["seconds"]
            row["requests_per_s"] = row["requests"] / row["seconds"]
            row["examples_per_s_model"] = row["n"] / row["model_s"] if row.get("model_s") else None
            log(f"  {spec['name']} {name}: {row['n']} items, {row['examples_per_s']:,.1f} examples/s, acc "
                f"{row['acc']:.4f}, acc_norm {row['acc_norm']:.4f}: {time.perf_counter() - started:.1f} s")  # fmt: skip
        else:
            log(f"  {spec['name']} {name}: {time.perf_counter() - started:.1f} s")
        save()

    try:
        out["generate"], model, tokenizer = generate_row(hf_dir, spec, device, dtype)
    except Exception as exc:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        out["generate"] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
    if out["generate"].get("class", "").startswith("Mamba"):  # transformers' fast path needs both packages
        out["generate"]["fast_kernels"] = all(importlib.util.find_spec(m) is not None
                                              for m in ("mamba_ssm", "causal_conv1d"))  # fmt: skip
    log(f"  {spec['name']} generate: {out['generate'].get('tokens_per_s', 0):.1f} tokens/s")
    save()

    started = time.perf_counter()
    try:
        scorer, _, checkpoint = scorer_for_run(run_dir, None, spec["batch_size"])
        native_load = time.perf_counter() - started
        out["checkpoint"] = str(checkpoint)
        if "text" in out["generate"]:  # anytrain's own greedy continuation of the same prompt
            native_text = scorer.generate_until(spec["prompt"], [], spec["max_new_tokens"])
            hf_text = out["generate"]["text"]
            same = next((i for i, (a, b) in enumerate(zip(native_text, hf_text, strict=False)) if a != b),
                        min(len(native_text), len(hf_text)))  # fmt: skip
            out["generate"].update(native_text=native_text, common_prefix_chars=same)
    except Exception as exc:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        native_load, scorer = None, None
        stacks["native"] = stacks["bridge"] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}

    def bridge() -> dict:
        timer = Timer(scorer.loglikelihood)
        scorer.loglikelihood = timer
        try:
            return {"load_s": native_load, "model": "anytrain (evals/lm_eval_bridge.py)",
                    **lm_eval_row(lambda limit: run_lm_eval(scorer, [TASK], include_path, limit=limit,
                                                            builtin_tasks=False)[TASK],
                                  timer, task, limits.get("bridge", 0), spec, device)}  # fmt: skip
        finally:
            del scorer.loglikelihood

    if scorer is not None and "native" in spec["stacks"]:
        prefixes = {**spec, "prefixes": list(limits.values())}
        attempt("native", lambda: {"load_s": native_load, **native_row(scorer, task_file, prefixes, device)})
    if scorer is not None and "bridge" in spec["stacks"]:
        attempt("bridge", bridge)
    scorer = None  # the anytrain model leaves the device before HFLM runs
    _free(device)

    def hflm() -> dict:
        if model is None:
            raise RuntimeError("the transformers model did not load (see generate)")
        from lm_eval.models.huggingface import HFLM

        started = time.perf_counter()
        lm = HFLM(pretrained=model, tokenizer=str(hf_dir), batch_size=spec["batch_size"], add_bos_token=True,
                  softmax_dtype=torch.float32)  # fmt: skip
        load = time.perf_counter() - started + out["generate"].get("load_s", 0.0)
        first = lm.tok_encode(task.items[0].context(0))[:1]  # add_bos_token: <|endoftext|> first, as the native scorer
        timer = Timer(lm.loglikelihood)
        lm.loglikelihood = timer
        row = lm_eval_row(lambda limit: hflm_evaluate(lm, include_path, limit), timer, task, limits.get("hflm", 0),
                          spec, device)  # fmt: skip
        args = {"add_bos_token": True, "softmax_dtype": "float32", "batch_size": spec["batch_size"],
                "dtype": str(dtype)}  # fmt: skip
        return {"load_s": load, "model": "lm_eval.models.huggingface.HFLM", "args": args,
                "eos_first": first == [lm.eot_token_id], **row}  # fmt: skip

    if "hflm" in spec["stacks"]:
        attempt("hflm", hflm)
    base, base_model = (stacks.get("hflm", {}).get(k) for k in ("examples_per_s", "examples_per_s_model"))
    for row in stacks.values():
        if base and "examples_per_s" in row:
            row["vs_hflm"] = row["examples_per_s"] / base
        if base_model and row.get("examples_per_s_model"):
            row["vs_hflm_model"] = row["examples_per_s_model"] / base_model
    if gpu:
        out["peak_mem_gib"] = hardware.peak_memory_gib(device)
    save()
    return out


# --------------------------------------------------------------------------------------------------------------------
# stages of a recipe


class Budget:
    def __init__(self, seconds: float) -> None:
        self.seconds, self.started = seconds, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def left(self) -> float:
        return self.seconds - self.elapsed()


def run_stage(name: str, cmd: list[str], log_file: Path, budget: Budget, in_process: bool) -> float:
    """Run ``cmd`` (an anytrain CLI or this script) with its output in ``log_file``; seconds. In-process (--smoke):
    the anytrain CLI's ``main`` in this process. Raises RuntimeError with the log's tail on failure."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if in_process:
        from unittest import mock

        from anytrain import cli

        buffer = io.StringIO()
        code = 0
        with mock.patch.object(sys, "argv", ["anytrain", *cmd]), contextlib.redirect_stdout(buffer), \
                contextlib.redirect_stderr(buffer):  # fmt: skip
            try:
                cli.main()
            except SystemExit as exc:
                code = exc.code or 0
        log_file.write_text(buffer.getvalue())
    else:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
        argv = [sys.executable, "-m", "anytrain", *cmd] if not cmd[0].endswith(".py") else [sys.executable, *cmd]
        with log_file.open("w") as handle:
            try:
                code = subprocess.run(argv, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                      timeout=max(budget.left(), 30.0)).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                code = "timeout (--budget-s)"
    seconds = time.perf_counter() - started
    tail = log_file.read_text(errors="replace").splitlines()
    if code != 0:
        print("\n".join(tail[-40:]), flush=True)
        raise RuntimeError(f"{name} exited {code} after {seconds:.1f} s: {' | '.join(tail[-3:])[-400:]}")
    return seconds


def recipe_info(recipe: str) -> dict:
    import yaml

    cfg = yaml.safe_load(Path(recipe).read_text())  # recipes are resolved against the repo root in main()
    model, train = cfg.get("model", {}), cfg.get("train", {})
    return {"arch": model.get("arch"), "flavour": model.get("flavour"), "micro_batch": train.get("micro_batch", 0),
            "recipe_compile": bool(train.get("compile", False))}  # fmt: skip


def compiled(info: dict, args: argparse.Namespace) -> bool:
    """Whether the training stage keeps the recipe's torch.compile: ``--compile recipe`` for every recipe, ``auto``
    (default) for all but Mamba, ``off`` never (the recipe's own ``train.compile`` false: never either)."""
    keep = args.compile == "recipe" or (args.compile == "auto" and info["arch"] != "mamba" and not args.smoke)
    return keep and info["recipe_compile"]


def train_args(recipe: str, run_dir: Path, data: Path, steps: int, args: argparse.Namespace) -> list[str]:
    """The ``anytrain train`` arguments. Micro-batch: ``--micro-batch``, else the recipe's, at most the global batch
    and, when eager, at most 4. Compiled, configs/1.1b.yaml runs at micro-batch 8 (39.5 GiB peak, measured; 59.5 GiB
    at its own 16); eager at 8 it ran out of memory on an H100 80GB. Eager mamba-1.4b at 4 trained on an H100 (the
    compiled recipe needs 72.7 GiB at 8; its compile time is not worth it for a hundred steps)."""
    info = recipe_info(recipe)
    micro = args.micro_batch or (info["micro_batch"] or args.global_batch)
    if not args.micro_batch and not compiled(info, args):
        micro = min(micro, 4)  # eager keeps more activations than compiled code (1.1B eager at 8: out of memory)
    micro = min(micro, args.global_batch)
    cmd = ["train", recipe, "--run-dir", str(run_dir), "--overwrite", "--data.path", str(data), "--data.seq_len",
           str(args.seq_len), "--train.steps", str(steps), "--train.global_batch", str(args.global_batch),
           "--train.micro_batch", str(micro), "--train.warmup_steps", str(max(1, steps // 10)),
           "--train.eval_interval", "0", "--train.eval_batches", "1", "--train.log_interval",
           str(max(1, min(20, steps))), "--checkpoint.interval", "0", "--checkpoint.keep_last", "1",
           "--checkpoint.checksums", "false"]  # fmt: skip
    if not compiled(info, args):
        cmd += ["--train.compile", "false"]
    if args.smoke:
        # a model vocabulary larger than the data's tokenizer (512), as the GPU recipes' (32000, 50280) over 8192
        cmd += ["--model.flavour", "debug", "--model.args.vocab_size", "640", "--train.dtype", "fp32",
                "--device", "cpu"]  # fmt: skip
    return cmd + args.train_args.split()


def stack_limits(args: argparse.Namespace, arch: str | None) -> dict[str, int]:
    """{stack: item limit} of a recipe of ``arch`` from ``--stack-items STACK[@ARCH]=N ...`` (later entries win)."""
    limits = {}
    for entry in args.stack_items:
        target, _, count = entry.partition("=")
        stack, _, only = target.partition("@")
        if not only or only == arch:
            limits[stack] = int(count)
    return limits


def parse_stack_items(entries: list[str]) -> list[str]:
    for entry in entries:
        target, eq, count = entry.partition("=")
        if not eq or target.partition("@")[0] not in STACKS or not count.isdigit():
            raise SystemExit(f"error: --stack-items {entry}: expected STACK[@ARCH]=N with STACK one of "
                             f"{', '.join(STACKS)} and N >= 0")  # fmt: skip
    return entries


def run_recipe(entry: str, args: argparse.Namespace, task: dict, work: Path, budget: Budget, rows: list[dict],
               save) -> dict:  # fmt: skip
    """Train, export and evaluate one recipe; its row joins ``rows`` at once and ``save()`` (the result JSON) runs
    after every stage, so that a run killed later keeps what finished."""
    recipe, _, steps = entry.partition(":")
    steps = int(steps or args.steps)
    name = Path(recipe).stem
    row: dict = {"recipe": recipe, "name": name, **recipe_info(recipe), "steps": steps, "seq_len": args.seq_len,
                 "global_batch": args.global_batch, "stages": {}}  # fmt: skip
    rows.append(row)
    if budget.left() <= 0:
        row["error"] = f"skipped: --budget-s {budget.seconds:.0f} spent ({budget.elapsed():.0f} s)"
        log(f"{name}: {row['error']}")
        save()
        return row
    base = work / name
    run_dir, hf_dir = base / "run", base / "hf"
    logs = Path(args.logs)
    stages = row["stages"]
    try:
        cmd = train_args(recipe, run_dir, Path(args.data), steps, args)
        row["train_cmd"] = "python -m anytrain " + " ".join(cmd)
        row["micro_batch_used"] = int(cmd[cmd.index("--train.micro_batch") + 1])
        row["compile"] = "--train.compile" not in cmd  # False: eager (--train.compile false)
        stages["train_s"] = run_stage("train", cmd, logs / f"{name}_train.log", budget, args.smoke)
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
        losses = [m for m in metrics if "loss" in m]
        row["final_loss"] = losses[-1]["loss"] if losses else None
        row["tokens_per_s_train"] = next((m.get("tokens_per_s") for m in reversed(losses) if m.get("tokens_per_s")),
                                         None)  # fmt: skip
        log(f"{name} train: {stages['train_s']:.1f} s ({steps} steps, micro-batch {row['micro_batch_used']}, "
            f"{'compiled' if row['compile'] else 'eager'}, final loss {row['final_loss']}, "
            f"{row['tokens_per_s_train'] or 0:,.0f} tokens/s)")  # fmt: skip
        save()
        cmd = ["export", str(run_dir), "--format", "hf", "--out", str(hf_dir), "--dtype",
               "fp32" if args.smoke else "bf16", "--overwrite"]  # fmt: skip
        stages["export_s"] = run_stage("export", cmd, logs / f"{name}_export.log", budget, args.smoke)
        row["export_gb"] = sum(f.stat().st_size for f in hf_dir.iterdir()) / 1e9
        log(f"{name} export: {stages['export_s']:.1f} s ({row['export_gb']:.2f} GB)")
        save()
        row_file = logs / f"{name}_eval_row.json"  # the child's row so far (after each stack): kept when killed
        row_file.unlink(missing_ok=True)
        limits = {k: v for k, v in stack_limits(args, row["arch"]).items() if k in args.stacks and v > 0}
        if limits:
            row["stack_items"] = limits
        spec = {"name": name, "run_dir": str(run_dir), "hf_dir": str(hf_dir), "task_file": task["file"],
                "batch_size": args.batch_size, "prompt": args.prompt, "max_new_tokens": args.max_new_tokens,
                "warmup_items": args.warmup_items, "stacks": args.stacks, "stack_items": limits,
                "row_file": str(row_file), "device": "cpu" if args.smoke else "auto"}  # fmt: skip
        started = time.perf_counter()
        try:
            if args.smoke:
                eval_stage(spec)
            else:
                spec_file = base / "eval_spec.json"
                spec_file.write_text(json.dumps(spec))
                run_stage("eval", [__file__, "--eval-child", str(spec_file)], logs / f"{name}_eval.log", budget,
                          False)  # fmt: skip
        finally:
            stages["eval_s"] = time.perf_counter() - started
            if row_file.is_file():
                row.update(json.loads(row_file.read_text()))
        log(f"{name} eval: {stages['eval_s']:.1f} s")
    except Exception as exc:  # noqa: BLE001 - one failing recipe must not lose the other
        row["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
        log(f"{name}: {row['error']}")
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    save()
    print_table([row])
    return row


# --------------------------------------------------------------------------------------------------------------------
# report


def print_table(rows: list[dict]) -> None:
    print(f"\n{'recipe':<16}{'stack':<8}{'items':>6}{'examples/s':>12}{'vs HFLM':>9}{'model-only/s':>14}{'vs HFLM':>9}"
          f"{'acc':>8}{'acc_norm':>10}{'load s':>8}  native on the same items (acc, acc_norm)")  # fmt: skip
    for r in rows:
        if "error" in r and not r.get("stacks"):
            print(f"{r['name']:<16}{r['error'][:100]}")
            continue
        for stack in [k for k in STACKS if k in r.get("stacks", {})]:
            s = r["stacks"][stack]
            if "error" in s:
                print(f"{r['name']:<16}{stack:<8}  {s['error'][:90]}")
                continue
            model = f"{s['examples_per_s_model']:,.1f}" if s.get("examples_per_s_model") else ""
            ratio = f"{s['vs_hflm']:.2f}x" if s.get("vs_hflm") else ""
            ratio_model = f"{s['vs_hflm_model']:.2f}x" if s.get("vs_hflm_model") else ""
            load = f"{s['load_s']:.1f}" if s.get("load_s") is not None else ""
            same = r["stacks"].get("native", {}).get("first", {}).get(str(s["n"])) if s.get("item_limit") else None
            same = f"  {same['acc']:.4f}, {same['acc_norm']:.4f}" if same else ""
            print(f"{r['name']:<16}{stack:<8}{s['n']:>6}{s['examples_per_s']:>12,.1f}{ratio:>9}{model:>14}"
                  f"{ratio_model:>9}{s['acc']:>8.4f}{s['acc_norm']:>10.4f}{load:>8}{same}")  # fmt: skip
    print()
    for r in rows:
        g = r.get("generate", {})
        if "tokens_per_s" in g:
            print(f"{r['name']}: transformers {g['class']} greedy {g['new_tokens']} tokens at {g['tokens_per_s']:.1f} "
                  f"tokens/s: {g['text']!r}")  # fmt: skip
            if "native_text" in g:
                print(f"{' ' * len(r['name'])}  anytrain's greedy text: {g['native_text']!r} (same first "
                      f"{g['common_prefix_chars']} characters)")  # fmt: skip
        stages = "  ".join(f"{k[:-2]} {v:.1f} s" for k, v in r.get("stages", {}).items())
        print(f"{r['name']}: {stages}" + (f"  error: {r['error'][:200]}" if "error" in r else ""))


def versions(device) -> dict:
    from bench_common import versions as common_versions

    out = common_versions(device)
    for name in ("lm_eval", "datasets", "huggingface_hub", "tokenizers"):
        try:
            module = __import__(name)
            out[name] = getattr(module, "__version__", None)
            if out[name] is None:
                from importlib.metadata import version

                out[name] = version(name.replace("_", "-"))
        except Exception:  # noqa: BLE001
            out[name] = None
    return out


def prepare_smoke_data(work: Path) -> Path:
    """Three plays of the embedded corpus, a 512-token vocabulary (seconds on a CPU)."""
    from anytrain.data.prepare import embedded_corpus_dir, prepare

    raw = work / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for file in sorted(embedded_corpus_dir().glob("*_gut.txt"))[:3]:
        (raw / file.name).write_text(file.read_text(encoding="utf-8", errors="replace"))
    out = work / "data"
    prepare([str(raw)], out, vocab_size=512, val_fraction=0.34, overwrite=True, progress=False)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipes", nargs="*", help=f"RECIPE[:STEPS] (default: {' '.join(RECIPES)})")
    parser.add_argument("--data", default=None, help="prepared dataset (default: the repo's data/shakespeare)")
    parser.add_argument("--steps", type=int, default=100, help="training steps of a recipe given without :STEPS")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=0,
                        help="0: the recipe's (1.1B compiled: 8, 39.5 GiB), at most the global batch and, eager, at "
                             "most 4 (eager mamba-1.4b: 4)")  # fmt: skip
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--compile", nargs="?", const="recipe", default="auto", choices=["auto", "recipe", "off"],
                        help="auto (default): Transformer recipes keep their train.compile (configs/1.1b.yaml: "
                             "compiled, micro-batch 8, 39.5 GiB; eager at 8 ran out of memory on an 80 GB H100), "
                             "Mamba recipes train eagerly (micro-batch 4); recipe (or a bare --compile): every recipe "
                             "keeps its compile; off: all eager")  # fmt: skip
    parser.add_argument("--train-args", default="", help="more `anytrain train` overrides, one string")
    parser.add_argument("--items", type=int, default=500, help="task items")
    parser.add_argument("--choices", type=int, default=4)
    parser.add_argument("--context-words", type=int, default=24)
    parser.add_argument("--choice-words", type=int, default=6)
    parser.add_argument("--stacks", nargs="+", default=STACKS, choices=STACKS,
                        help="hflm needs accelerate besides lm-eval")  # fmt: skip
    parser.add_argument("--stack-items", nargs="*", default=STACK_ITEMS, metavar="STACK[@ARCH]=N",
                        help="score only the first N items with STACK (for recipes of ARCH only, when given); the "
                             "native row also reports acc / acc_norm on those items. Default: hflm@mamba=64 "
                             "(transformers' slow PyTorch Mamba scan without mamba_ssm / causal_conv1d); give "
                             "--stack-items alone for every stack on every item")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per forward, all three stacks")
    parser.add_argument("--warmup-items", type=int, default=16, help="untimed warm-up pass of each stack (0: none)")
    parser.add_argument("--prompt", default="ROMEO.\n")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="skip a recipe that would start later; kill a stage running past it")  # fmt: skip
    parser.add_argument("--work", default=None, help="work directory (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the runs and exports in --work")
    parser.add_argument("--results", default=str(ROOT / "bench" / "results"),
                        help="where eval_throughput_<device>.json goes (not with --smoke)")  # fmt: skip
    parser.add_argument("--out", default=None, help="also write the result JSON (and stage logs) here")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU check: tiny recipes, debug flavour, fp32, 2 steps, 12 items")  # fmt: skip
    parser.add_argument("--eval-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.stack_items = parse_stack_items(args.stack_items)
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TQDM_DISABLE", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
        os.environ.setdefault(name, "1")  # before anything imports tqdm / datasets (children inherit them)

    if args.eval_child:  # a child process: the eval stage of one recipe
        spec_file = Path(args.eval_child)
        eval_stage(json.loads(spec_file.read_text()))  # writes its row (spec's row_file) after every step
        return

    if args.smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU check everywhere: every stage on the CPU
        args.recipes = args.recipes or [f"{r}:2" for r in SMOKE_RECIPES]
        args.seq_len, args.global_batch, args.batch_size = min(args.seq_len, 64), min(args.global_batch, 4), 8
        args.items, args.context_words, args.choice_words = min(args.items, 12), 8, 3
        args.max_new_tokens, args.warmup_items = min(args.max_new_tokens, 8), 0
    args.recipes = args.recipes or RECIPES
    resolved = []  # RECIPE[:STEPS] with RECIPE relative to the current directory or, failing that, the repo root
    for entry in args.recipes:
        recipe, colon, steps = entry.partition(":")
        path = Path(recipe) if Path(recipe).is_file() else ROOT / recipe
        resolved.append(str(path.resolve()) + colon + steps)
    args.recipes = resolved
    budget = Budget(args.budget_s)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="anytrain-eval-throughput-"))
    work.mkdir(parents=True, exist_ok=True)
    args.logs = str(Path(args.out) / "eval_throughput_logs" if args.out else work / "logs")
    started = time.perf_counter()
    if args.data is None:
        args.data = str(prepare_smoke_data(work) if args.smoke else ROOT / "data" / "shakespeare")
        if args.smoke:
            log(f"smoke data: {time.perf_counter() - started:.1f} s")
    started = time.perf_counter()
    args.data = str(Path(args.data).resolve())  # the stages run in the repo root
    task = build_task(Path(args.data), work / "task", args.items, args.choices, args.context_words,
                      args.choice_words)  # fmt: skip
    log(f"task: {task['items']} items x {task['choices']} choices from {args.data}: "
        f"{time.perf_counter() - started:.1f} s")  # fmt: skip
    targets = [] if args.smoke else [Path(args.results)]
    targets += [Path(args.out)] if args.out else []
    options = {k: v for k, v in vars(args).items() if k not in ("eval_child",)}
    rows: list[dict] = []

    def save() -> None:
        """The rows so far in ``PARTIAL`` (in --out, else the results folder): what a killed run leaves."""
        if targets:
            partial = {"task": task, "wall_s": budget.elapsed(), "options": options, "complete": False, "rows": rows}
            targets[-1].mkdir(parents=True, exist_ok=True)
            temp = targets[-1] / (PARTIAL + ".tmp")
            temp.write_text(json.dumps(partial, indent=1, default=str))
            os.replace(temp, targets[-1] / PARTIAL)

    for entry in args.recipes:
        run_recipe(entry, args, task, work, budget, rows, save)
    print_table(rows)

    from anytrain import hardware

    device = hardware.resolve_device("cpu" if args.smoke else "auto")
    env = versions(device)
    slug = "smoke" if args.smoke else re.sub(r"[^a-z0-9]+", "-", env["device"].lower()).strip("-")
    result = {"device": env, "task": task, "wall_s": budget.elapsed(), "options": options, "complete": True,
              "rows": rows}  # fmt: skip
    text = json.dumps(result, indent=1, default=str)
    for folder in targets:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"eval_throughput_{slug}.json").write_text(text)
        log(f"wrote {folder / f'eval_throughput_{slug}.json'}")
    if targets:
        (targets[-1] / PARTIAL).unlink(missing_ok=True)
    if not args.keep and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    failed = [r for r in rows if "error" in r or "error" in r.get("generate", {})
              or any("error" in s for s in r.get("stacks", {}).values())]  # fmt: skip
    log(f"total {budget.elapsed():.1f} s" + (f"; {len(failed)} recipe(s) with errors" if failed else ""))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
