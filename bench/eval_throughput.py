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

    PYTHONPATH=src python -m bench.eval_throughput --out /tmp/eval                # GPU: both recipes (~6.5 minutes)
    PYTHONPATH=src python -m bench.eval_throughput configs/1.1b.yaml:100 --items 200   # RECIPE[:STEPS]
    PYTHONPATH=src python -m bench.eval_throughput --smoke --out /tmp/eval         # CPU check: tiny recipes, 2 steps

``bash bench/device/eval_check.sh`` is the one-call GPU command (wheels, corpus, this bench). Needs transformers and
lm-eval (``pip install 'anytrain[hf,eval]'``); offline: ``HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import argparse
import contextlib
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

from anytrain.evals.lm_eval_bridge import write_local_task  # imports no lm-eval: a YAML writer
from bench.common import child_env
from bench.eval_stage import SEED, TASK, eval_stage, log

ROOT = Path(__file__).resolve().parents[1]

RECIPES = ["configs/1.1b.yaml:100", "configs/mamba-1.4b.yaml:100"]
SMOKE_RECIPES = ["configs/tiny.yaml", "configs/tiny-mamba.yaml"]
STACKS = ["native", "bridge", "hflm"]
# HFLM over transformers' MambaForCausalLM: without mamba_ssm and causal_conv1d transformers runs its PyTorch scan, a
# Python loop over the tokens in each of the 48 layers; 500 items did not finish in the time left (> 170 s, H100)
STACK_ITEMS = ["hflm@mamba=64"]
PARTIAL = "eval_throughput.partial.json"  # not eval_throughput_<device>.json

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


def build_task(
    data_dir: Path, out_dir: Path, items: int, choices: int, context_words: int, choice_words: int, seed: int = SEED
) -> dict:
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
    return {
        "file": str(jsonl),
        "items": items,
        "choices": choices,
        "context_words": context_words,
        "choice_words": choice_words,
        "seed": seed,
        "corpus_words": len(words),
    }


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
    """Run ``cmd`` (an anytrain CLI command, or ``-m MODULE ...``) with its output in ``log_file``; seconds.
    In-process (--smoke): the anytrain CLI's ``main`` in this process. Raises RuntimeError with the log's tail on
    failure."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if in_process:
        from unittest import mock

        from anytrain import cli

        buffer = io.StringIO()
        code = 0
        with (
            mock.patch.object(sys, "argv", ["anytrain", *cmd]),
            contextlib.redirect_stdout(buffer),
            contextlib.redirect_stderr(buffer),
        ):
            try:
                cli.main()
            except SystemExit as exc:
                code = exc.code or 0
        log_file.write_text(buffer.getvalue())
    else:
        env = child_env()
        argv = [sys.executable, "-m", "anytrain", *cmd] if cmd[0] != "-m" else [sys.executable, *cmd]
        with log_file.open("w") as handle:
            try:
                code = subprocess.run(
                    argv, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=max(budget.left(), 30.0)
                ).returncode
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
    return {
        "arch": model.get("arch"),
        "flavour": model.get("flavour"),
        "micro_batch": train.get("micro_batch", 0),
        "recipe_compile": bool(train.get("compile", False)),
    }


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
    cmd = [
        "train",
        recipe,
        "--run-dir",
        str(run_dir),
        "--overwrite",
        "--data.path",
        str(data),
        "--data.seq_len",
        str(args.seq_len),
        "--train.steps",
        str(steps),
        "--train.global_batch",
        str(args.global_batch),
        "--train.micro_batch",
        str(micro),
        "--train.warmup_steps",
        str(max(1, steps // 10)),
        "--train.eval_interval",
        "0",
        "--train.eval_batches",
        "1",
        "--train.log_interval",
        str(max(1, min(20, steps))),
        "--checkpoint.interval",
        "0",
        "--checkpoint.keep_last",
        "1",
        "--checkpoint.checksums",
        "false",
    ]
    if not compiled(info, args):
        cmd += ["--train.compile", "false"]
    if args.smoke:
        # a model vocabulary larger than the data's tokenizer (512), as the GPU recipes' (32000, 50280) over 8192
        cmd += [
            "--model.flavour",
            "debug",
            "--model.args.vocab_size",
            "640",
            "--train.dtype",
            "fp32",
            "--device",
            "cpu",
        ]
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
            raise SystemExit(
                f"error: --stack-items {entry}: expected STACK[@ARCH]=N with STACK one of "
                f"{', '.join(STACKS)} and N >= 0"
            )
    return entries


def run_recipe(
    entry: str, args: argparse.Namespace, task: dict, work: Path, budget: Budget, rows: list[dict], save
) -> dict:
    """Train, export and evaluate one recipe; its row joins ``rows`` at once and ``save()`` (the result JSON) runs
    after every stage, so that a run killed later keeps what finished."""
    recipe, _, steps = entry.partition(":")
    steps = int(steps or args.steps)
    name = Path(recipe).stem
    row: dict = {
        "recipe": recipe,
        "name": name,
        **recipe_info(recipe),
        "steps": steps,
        "seq_len": args.seq_len,
        "global_batch": args.global_batch,
        "stages": {},
    }
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
        row["tokens_per_s_train"] = next(
            (m.get("tokens_per_s") for m in reversed(losses) if m.get("tokens_per_s")), None
        )
        log(
            f"{name} train: {stages['train_s']:.1f} s ({steps} steps, micro-batch {row['micro_batch_used']}, "
            f"{'compiled' if row['compile'] else 'eager'}, final loss {row['final_loss']}, "
            f"{row['tokens_per_s_train'] or 0:,.0f} tokens/s)"
        )
        save()
        cmd = [
            "export",
            str(run_dir),
            "--format",
            "hf",
            "--out",
            str(hf_dir),
            "--dtype",
            "fp32" if args.smoke else "bf16",
            "--overwrite",
        ]
        stages["export_s"] = run_stage("export", cmd, logs / f"{name}_export.log", budget, args.smoke)
        row["export_gb"] = sum(f.stat().st_size for f in hf_dir.iterdir()) / 1e9
        log(f"{name} export: {stages['export_s']:.1f} s ({row['export_gb']:.2f} GB)")
        save()
        row_file = logs / f"{name}_eval_row.json"  # the child's row so far (after each stack): kept when killed
        row_file.unlink(missing_ok=True)
        limits = {k: v for k, v in stack_limits(args, row["arch"]).items() if k in args.stacks and v > 0}
        if limits:
            row["stack_items"] = limits
        spec = {
            "name": name,
            "run_dir": str(run_dir),
            "hf_dir": str(hf_dir),
            "task_file": task["file"],
            "batch_size": args.batch_size,
            "prompt": args.prompt,
            "max_new_tokens": args.max_new_tokens,
            "warmup_items": args.warmup_items,
            "stacks": args.stacks,
            "stack_items": limits,
            "row_file": str(row_file),
            "device": "cpu" if args.smoke else "auto",
        }
        started = time.perf_counter()
        try:
            if args.smoke:
                eval_stage(spec)
            else:
                spec_file = base / "eval_spec.json"
                spec_file.write_text(json.dumps(spec))
                child = ["-m", "bench.eval_throughput", "--eval-child", str(spec_file)]
                run_stage("eval", child, logs / f"{name}_eval.log", budget, False)
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
    print(
        f"\n{'recipe':<16}{'stack':<8}{'items':>6}{'examples/s':>12}{'vs HFLM':>9}{'model-only/s':>14}{'vs HFLM':>9}"
        f"{'acc':>8}{'acc_norm':>10}{'load s':>8}  native on the same items (acc, acc_norm)"
    )
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
            print(
                f"{r['name']:<16}{stack:<8}{s['n']:>6}{s['examples_per_s']:>12,.1f}{ratio:>9}{model:>14}"
                f"{ratio_model:>9}{s['acc']:>8.4f}{s['acc_norm']:>10.4f}{load:>8}{same}"
            )
    print()
    for r in rows:
        g = r.get("generate", {})
        if "tokens_per_s" in g:
            print(
                f"{r['name']}: transformers {g['class']} greedy {g['new_tokens']} tokens at {g['tokens_per_s']:.1f} "
                f"tokens/s: {g['text']!r}"
            )
            if "native_text" in g:
                print(
                    f"{' ' * len(r['name'])}  anytrain's greedy text: {g['native_text']!r} (same first "
                    f"{g['common_prefix_chars']} characters)"
                )
        stages = "  ".join(f"{k[:-2]} {v:.1f} s" for k, v in r.get("stages", {}).items())
        print(f"{r['name']}: {stages}" + (f"  error: {r['error'][:200]}" if "error" in r else ""))


def versions(device) -> dict:
    from bench.common import versions as common_versions

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
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=0,
        help="0: the recipe's (1.1B compiled: 8, 39.5 GiB), at most the global batch and, eager, at "
        "most 4 (eager mamba-1.4b: 4)",
    )
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument(
        "--compile",
        nargs="?",
        const="recipe",
        default="auto",
        choices=["auto", "recipe", "off"],
        help="auto (default): Transformer recipes keep their train.compile (configs/1.1b.yaml: "
        "compiled, micro-batch 8, 39.5 GiB; eager at 8 ran out of memory on an 80 GB H100), "
        "Mamba recipes train eagerly (micro-batch 4); recipe (or a bare --compile): every recipe "
        "keeps its compile; off: all eager",
    )
    parser.add_argument("--train-args", default="", help="more `anytrain train` overrides, one string")
    parser.add_argument("--items", type=int, default=500, help="task items")
    parser.add_argument("--choices", type=int, default=4)
    parser.add_argument("--context-words", type=int, default=24)
    parser.add_argument("--choice-words", type=int, default=6)
    parser.add_argument(
        "--stacks", nargs="+", default=STACKS, choices=STACKS, help="hflm needs accelerate besides lm-eval"
    )
    parser.add_argument(
        "--stack-items",
        nargs="*",
        default=STACK_ITEMS,
        metavar="STACK[@ARCH]=N",
        help="score only the first N items with STACK (for recipes of ARCH only, when given); the "
        "native row also reports acc / acc_norm on those items. Default: hflm@mamba=64 "
        "(transformers' slow PyTorch Mamba scan without mamba_ssm / causal_conv1d); give "
        "--stack-items alone for every stack on every item",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per forward, all three stacks")
    parser.add_argument("--warmup-items", type=int, default=16, help="untimed warm-up pass of each stack (0: none)")
    parser.add_argument("--prompt", default="ROMEO.\n")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--budget-s",
        type=float,
        default=450.0,
        help="skip a recipe that would start later; kill a stage running past it",
    )
    parser.add_argument("--work", default=None, help="work directory (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the runs and exports in --work")
    parser.add_argument(
        "--results",
        default=str(ROOT / "bench" / "results"),
        help="where eval_throughput_<device>.json goes (not with --smoke)",
    )
    parser.add_argument("--out", default=None, help="also write the result JSON (and stage logs) here")
    parser.add_argument(
        "--smoke", action="store_true", help="CPU check: tiny recipes, debug flavour, fp32, 2 steps, 12 items"
    )
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
    task = build_task(Path(args.data), work / "task", args.items, args.choices, args.context_words, args.choice_words)
    log(
        f"task: {task['items']} items x {task['choices']} choices from {args.data}: "
        f"{time.perf_counter() - started:.1f} s"
    )
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
    result = {
        "device": env,
        "task": task,
        "wall_s": budget.elapsed(),
        "options": options,
        "complete": True,
        "rows": rows,
    }
    text = json.dumps(result, indent=1, default=str)
    for folder in targets:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"eval_throughput_{slug}.json").write_text(text)
        log(f"wrote {folder / f'eval_throughput_{slug}.json'}")
    if targets:
        (targets[-1] / PARTIAL).unlink(missing_ok=True)
    if not args.keep and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    failed = [
        r
        for r in rows
        if "error" in r or "error" in r.get("generate", {}) or any("error" in s for s in r.get("stacks", {}).values())
    ]
    log(f"total {budget.elapsed():.1f} s" + (f"; {len(failed)} recipe(s) with errors" if failed else ""))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
