"""Short training runs of anytrain recipes on this machine: tokens/s, MFU, peak memory, loss.

Each recipe runs through the real CLI (`python -m anytrain train ...`) in its own process, for --steps optimizer
steps; throughput is the mean over log windows after the first (which holds compilation and warm-up).

    PYTHONPATH=src python -m bench.train_check --recipes configs/tiny.yaml configs/125m.yaml --steps 50 \
        --data data/shakespeare --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_recipe(recipe: str, steps: int, data: str, extra: list[str], work: Path) -> dict:
    run_dir = work / Path(recipe).stem
    cmd = [
        sys.executable,
        "-m",
        "anytrain",
        "train",
        recipe,
        "--run-dir",
        str(run_dir),
        "--overwrite",
        "--train.steps",
        str(steps),
        "--train.log_interval",
        "10",
        "--train.eval_interval",
        "0",
        "--data.path",
        data,
        "--checkpoint.interval",
        "0",
        *extra,
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"recipe": recipe, "error": proc.stderr[-2000:]}
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    return {
        "recipe": recipe,
        "overrides": extra,
        "steps": steps,
        "wall_s": round(time.perf_counter() - started, 1),
        "params": summary["params"],
        "seq_len": summary["config"]["data"]["seq_len"],
        "global_batch": summary["config"]["train"]["global_batch"],
        "micro_batch": summary["config"]["train"]["micro_batch"],
        "compile": summary["config"]["train"]["compile"],
        "dtype": summary["dtype"],
        "tokens_per_s": summary["tokens_per_s"],
        "mfu": summary["mfu"],
        "peak_mem_gib": max(r["peak_mem_gib"] for r in train),
        "first_loss": train[0]["loss"],
        "last_loss": train[-1]["loss"],
        "final_val_loss": summary["final_val_loss"],
        "hardware": summary["hardware"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=["configs/tiny.yaml", "configs/125m.yaml"])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--data", default="data/shakespeare")
    parser.add_argument("--out", default="bench/results")
    args, overrides = parser.parse_known_args()  # anything else, e.g. --train.compile=false, goes to every recipe
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in args.recipes:
            rows.append(run_recipe(recipe, args.steps, args.data, overrides, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    ok = [r for r in rows if "error" not in r]
    device = ok[0]["hardware"]["device"] if ok else "unknown"
    print(f"\n{'recipe':<22}{'params':>12}{'seq':>6}{'batch':>7}{'tokens/s':>12}{'MFU':>8}{'peak GiB':>10}{'loss':>16}")
    for r in rows:
        if "error" in r:
            print(f"{r['recipe']:<22} FAILED: {r['error'].strip().splitlines()[-1]}")
            continue
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        print(
            f"{r['recipe']:<22}{r['params'] / 1e6:>11.1f}M{r['seq_len']:>6}{r['global_batch']:>7}"
            f"{r['tokens_per_s']:>12,.0f}{mfu:>8}{r['peak_mem_gib']:>10.2f}"
            f"{r['first_loss']:>8.3f}->{r['last_loss']:.3f}"
        )
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"train_check_{slug}.json"
    path.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "device": device, "runs": rows}, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
