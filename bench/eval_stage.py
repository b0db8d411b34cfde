"""The eval stage of bench/eval_throughput.py, for one recipe's run and its Hugging Face export: generation with
transformers, then the native scorer, the lm-eval bridge and lm-eval's HFLM scoring the same task, each timed
(``eval_stage``). On GPUs it runs in a fresh process (``python -m bench.eval_throughput --eval-child SPEC``); with
``--smoke`` in the bench's own process.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import time
from pathlib import Path

TASK = "anytrain_corpus_mc"
SEED = 1234


def log(message: str) -> None:
    print(f"[eval_throughput] {message}", flush=True)


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
    row = {
        "load_s": time.perf_counter() - started,
        "class": type(model).__name__,
        "dtype": str(dtype),
        "params": sum(p.numel() for p in model.parameters()),
    }
    eos = tokenizer.eos_token_id
    ids = torch.tensor([[eos] + tokenizer(spec["prompt"], add_special_tokens=False).input_ids], device=device)
    new = spec["max_new_tokens"]

    def generate(n: int):
        with torch.no_grad():
            return model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id or eos,
            )

    generate(min(4, new))  # warm-up: first kernels, caches
    _sync(device)
    started = time.perf_counter()
    out = generate(new)
    _sync(device)
    seconds = time.perf_counter() - started
    tokens = out[0, ids.shape[1] :].tolist()
    row.update(
        prompt=spec["prompt"],
        new_tokens=len(tokens),
        seconds=seconds,
        tokens_per_s=len(tokens) / seconds,
        text=tokenizer.decode(tokens, skip_special_tokens=True),
        token_ids=tokens,
    )
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
    first = {
        str(n): {"acc": sum(right[:n]) / n, "acc_norm": sum(right_norm[:n]) / n}
        for n in sorted(set(spec.get("prefixes", [])))
        if 0 < n < len(task.items)
    }
    return {
        "acc": metrics["acc"],
        "acc_norm": metrics["acc_norm"],
        "n": metrics["n"],
        "seconds": seconds,
        "model_s": timer.seconds,
        "requests": requests,
        "timed": "evals.tasks.score_task (model loaded)",
        **({"first": first} if first else {}),
    }


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
    return {
        "acc": metrics["acc"],
        "acc_norm": metrics["acc_norm"],
        "n": metrics.get("n") or len(items),
        "seconds": seconds,
        "model_s": model_timer.seconds,
        "requests": sum(len(item.continuations) for item in items),
        "timed": "lm_eval.simple_evaluate (model loaded)",
        **({"item_limit": limit} if 0 < limit < len(task.items) else {}),
    }


def hflm_evaluate(lm, include_path: Path, limit: int) -> dict:
    """lm-eval's simple_evaluate of the task on an lm-eval model, as ``run_lm_eval`` calls it for the bridge."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(include_path), include_defaults=False)
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=[TASK],
        num_fewshot=0,
        limit=limit or None,
        task_manager=manager,
        random_seed=SEED,
        numpy_random_seed=SEED,
        torch_random_seed=SEED,
        fewshot_random_seed=SEED,
    )
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
            log(
                f"  {spec['name']} {name}: {row['n']} items, {row['examples_per_s']:,.1f} examples/s, acc "
                f"{row['acc']:.4f}, acc_norm {row['acc_norm']:.4f}: {time.perf_counter() - started:.1f} s"
            )
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
        out["generate"]["fast_kernels"] = all(
            importlib.util.find_spec(m) is not None for m in ("mamba_ssm", "causal_conv1d")
        )
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
            same = next(
                (i for i, (a, b) in enumerate(zip(native_text, hf_text, strict=False)) if a != b),
                min(len(native_text), len(hf_text)),
            )
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
            return {
                "load_s": native_load,
                "model": "anytrain (evals/lm_eval_bridge.py)",
                **lm_eval_row(
                    lambda limit: run_lm_eval(scorer, [TASK], include_path, limit=limit, builtin_tasks=False)[TASK],
                    timer,
                    task,
                    limits.get("bridge", 0),
                    spec,
                    device,
                ),
            }
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
        lm = HFLM(
            pretrained=model,
            tokenizer=str(hf_dir),
            batch_size=spec["batch_size"],
            add_bos_token=True,
            softmax_dtype=torch.float32,
        )
        load = time.perf_counter() - started + out["generate"].get("load_s", 0.0)
        first = lm.tok_encode(task.items[0].context(0))[:1]  # add_bos_token: <|endoftext|> first, as the native scorer
        timer = Timer(lm.loglikelihood)
        lm.loglikelihood = timer
        row = lm_eval_row(
            lambda limit: hflm_evaluate(lm, include_path, limit), timer, task, limits.get("hflm", 0), spec, device
        )
        args = {
            "add_bos_token": True,
            "softmax_dtype": "float32",
            "batch_size": spec["batch_size"],
            "dtype": str(dtype),
        }
        return {
            "load_s": load,
            "model": "lm_eval.models.huggingface.HFLM",
            "args": args,
            "eos_first": first == [lm.eot_token_id],
            **row,
        }

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
