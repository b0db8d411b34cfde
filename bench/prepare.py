"""Tokens/s and peak memory of ``anytrain prepare`` against a plain HF ``datasets`` pipeline, same tokenizer, same
generated corpus.

The corpus (``--size-mb``, default ~1 GB) is JSONL documents of words drawn with their frequencies from the embedded
Shakespeare corpus, written to a temporary folder (``--workdir DIR``: kept in DIR and reused). One byte-level BPE
tokenizer is trained on its first 20 MB and used by both sides:

* anytrain: ``prepare(corpus, out, tokenizer_path=..., workers=W)`` (train/val shards, index, EOS after each document);
* datasets: ``Dataset.from_json(files).map(encode, batched=True, num_proc=W, remove_columns=["text"])`` where
  ``encode`` calls the same ``tokenizers.Tokenizer.encode_batch_fast`` and appends EOS (the Arrow cache is written).

Each side runs in a fresh process; the time is measured inside it (imports excluded), and the peak memory is the
largest sum over that process and its children of the proportional set size (PSS: pages shared after a fork are
split between the processes that share them), sampled every 50 ms from /proc; the CPU seconds (user + system, over the
process tree, imports included) are less sensitive than the time to other jobs on the machine. Both sides run with
TOKENIZERS_PARALLELISM=false and W processes. Writes a table and bench/results/prepare_<host cpu>.json with versions.

    python -m bench.prepare --size-mb 1000 --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

ANYTRAIN_SIDE = """
import json, sys, time
from anytrain.data.prepare import prepare
corpus, out, tokenizer, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if __name__ == "__main__":
    start = time.perf_counter()
    index = prepare([corpus], out, tokenizer_path=tokenizer, workers=workers, progress=False)
    seconds = time.perf_counter() - start
    tokens = sum(s["tokens"] for s in index["meta"]["stats"].values())
    print(json.dumps({"seconds": seconds, "tokens": tokens}))
"""

DATASETS_SIDE = """
import glob, json, sys, time
import datasets
from tokenizers import Tokenizer
corpus, cache, tokenizer, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
tok = Tokenizer.from_file(tokenizer)
eos = tok.token_to_id("<|endoftext|>")

def encode(batch):
    return {"ids": [e.ids + [eos] for e in tok.encode_batch_fast(batch["text"], add_special_tokens=False)]}

if __name__ == "__main__":
    start = time.perf_counter()
    files = sorted(glob.glob(corpus + "/*.jsonl"))
    ds = datasets.Dataset.from_json(files, cache_dir=cache)
    out = ds.map(encode, batched=True, num_proc=workers, remove_columns=["text"])
    seconds = time.perf_counter() - start
    tokens = sum(len(x) for batch in out.with_format("arrow").iter(batch_size=10_000) for x in batch["ids"].to_pylist())
    print(json.dumps({"seconds": seconds, "tokens": tokens}))
"""


def make_corpus(folder: Path, size_mb: float, seed: int = 0) -> int:
    """JSONL files of ~4 KB documents of words drawn by frequency from the embedded corpus; returns bytes written."""
    from anytrain.data.readers import embedded_corpus_dir

    text = " ".join(f.read_text(errors="replace") for f in sorted(embedded_corpus_dir().glob("*_gut.txt")))
    words, counts = np.unique(np.array(text.split()), return_counts=True)
    p = counts / counts.sum()
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    target, written, part = int(size_mb * 1e6), 0, 0
    while written < target:
        with open(folder / f"part{part:03d}.jsonl", "w") as fh:
            # one draw per file: the same uniforms, in the same order, as one draw of 700 per document
            for row in rng.choice(len(words), (2000, 700), p=p):
                doc = " ".join(words[row])
                line = json.dumps({"text": doc}) + "\n"
                fh.write(line)
                written += len(line)
                if written >= target:
                    break
        part += 1
    return written


def corpus_and_tokenizer(folder: Path, size_mb: float, vocab_size: int) -> int:
    """``folder``/corpus (:func:`make_corpus`) and ``folder``/tokenizer.json (trained on the corpus's first 20 MB),
    made unless ``folder`` already holds both; returns the corpus's bytes."""
    from anytrain.data.prepare import train_tokenizer
    from anytrain.data.readers import iter_documents, list_inputs

    done = folder / "made.json"
    if done.is_file():
        return json.loads(done.read_text())["corpus_bytes"]
    if (folder / "corpus").exists():
        import shutil

        shutil.rmtree(folder / "corpus")  # an unfinished one
    folder.mkdir(parents=True, exist_ok=True)
    size = make_corpus(folder / "corpus", size_mb)
    texts, taken = [], 0
    for doc, _ in iter_documents(list_inputs([str(folder / "corpus")]), None, "text", "strict"):
        texts.append(doc.text)
        taken += len(doc.text)
        if taken > 20e6:
            break
    train_tokenizer(iter(texts), vocab_size).save(str(folder / "tokenizer.json"))
    done.write_text(json.dumps({"corpus_bytes": size, "size_mb": size_mb, "vocab_size": vocab_size}) + "\n")
    return size


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def _pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_side(code: str, args: list[str]) -> dict:
    """Run one side in a fresh process; its JSON result plus the peak PSS (MiB) and the CPU seconds (user + system,
    imports included) of its process tree."""
    import resource

    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], sum(_pss_kib(p) for p in _descendants(proc.pid)))
            time.sleep(0.05)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    out, err = proc.communicate()
    thread.join()
    if proc.returncode != 0:
        raise SystemExit(f"side failed (exit {proc.returncode}): {err[-2000:]}")
    now = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime
    result = json.loads(out.strip().splitlines()[-1])
    return {
        **result,
        "tokens_per_s": result["tokens"] / result["seconds"],
        "peak_pss_mib": peak[0] / 1024,
        "cpu_s": cpu,
        "tokens_per_cpu_s": result["tokens"] / cpu,
    }


def versions() -> dict:
    out = {"python": sys.version.split()[0], "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    for name in ("anytrain", "tokenizers", "datasets", "pyarrow", "numpy"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=1000.0, help="corpus size in MB (default ~1 GB)")
    parser.add_argument("--workers", type=int, default=2, help="processes on each side")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"), help="folder for the JSON result")
    parser.add_argument("--note", default="", help="recorded with the result (e.g. 'shared machine')")
    parser.add_argument(
        "--workdir",
        help="keep the generated corpus and tokenizer in this folder and reuse them on "
        "the next run of the same size (default: a temporary folder, removed)",
    )
    args = parser.parse_args()
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-prepare-", dir=args.workdir) as tmp:
        inputs = Path(args.workdir) / f"{args.size_mb:g}mb" if args.workdir else Path(tmp)
        size = corpus_and_tokenizer(inputs, args.size_mb, args.vocab_size)
        common = [str(inputs / "corpus"), "", str(inputs / "tokenizer.json"), str(args.workers)]
        rows = {
            "anytrain prepare": run_side(ANYTRAIN_SIDE, [common[0], str(Path(tmp) / "out"), *common[2:]]),
            "datasets from_json + map": run_side(DATASETS_SIDE, [common[0], str(Path(tmp) / "hf_cache"), *common[2:]]),
        }
    base = rows["datasets from_json + map"]
    print(f"corpus {size / 1e6:,.0f} MB, {args.workers} workers, vocab {args.vocab_size}")
    print(f"{'':28s} {'seconds':>9s} {'tokens/s':>12s} {'peak PSS MiB':>13s} {'CPU s':>8s}")
    for name, row in rows.items():
        print(
            f"{name:28s} {row['seconds']:9.1f} {row['tokens_per_s']:12,.0f} {row['peak_pss_mib']:13,.0f} "
            f"{row['cpu_s']:8.1f}"
        )
    speedup = rows["anytrain prepare"]["tokens_per_s"] / base["tokens_per_s"]
    memory = rows["anytrain prepare"]["peak_pss_mib"] / base["peak_pss_mib"]
    print(f"anytrain / datasets: {speedup:.2f}x tokens/s, {memory:.2f}x peak memory")
    result = {
        "corpus_bytes": size,
        "workers": args.workers,
        "vocab_size": args.vocab_size,
        "rows": rows,
        "speedup": speedup,
        "memory_ratio": memory,
        "note": args.note,
        "versions": versions(),
    }
    host = (platform.processor() or platform.machine()).lower().replace(" ", "-") or "cpu"
    path = Path(args.out) / f"prepare_{host}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
