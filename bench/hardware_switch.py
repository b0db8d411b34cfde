"""Move one run GPU -> CPU -> GPU through checkpoints and compare with the same run left on the GPU.

    PYTHONPATH=src python -m bench.hardware_switch --data data/shakespeare --out bench/results \
        --png docs/hardware_switch.png

Segments: steps 1-30 on the GPU (bf16 autocast), 31-40 resumed on the CPU (fp32), 41-50 resumed on the GPU.
Reports the loss of the switched run minus the uninterrupted GPU run at every step, in particular right after each
switch. ``--plot-only JSON`` redraws the PNG from a results file (e.g. on a machine with matplotlib).
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
STEPS, SWITCH_TO_CPU, SWITCH_TO_GPU = 50, 30, 40


def train(run_dir: Path, data: str, *extra: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "anytrain",
        "train",
        "configs/tiny.yaml",
        "--run-dir",
        str(run_dir),
        "--data.path",
        data,
        "--train.steps",
        str(STEPS),
        "--train.log_interval",
        "1",
        "--train.warmup_steps",
        "5",
        "--train.eval_interval",
        "0",
        "--train.eval_batches",
        "2",
        "--checkpoint.interval",
        "0",
        *extra,
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")


def step_losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = {int(k): v for k, v in result["uninterrupted"].items()}
    sw = {int(k): v for k, v in result["switched"].items()}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(list(ref), list(ref.values()), color="0.6", lw=3, label="uninterrupted (GPU)")
    segments = [
        (1, SWITCH_TO_CPU, "GPU (bf16)", "tab:green"),
        (SWITCH_TO_CPU + 1, SWITCH_TO_GPU, "CPU (fp32)", "tab:blue"),
        (SWITCH_TO_GPU + 1, STEPS, "GPU again (bf16)", "tab:green"),
    ]
    for i, (lo, hi, label, color) in enumerate(segments):
        xs = [s for s in sw if lo <= s <= hi]
        ax.plot(xs, [sw[s] for s in xs], color=color, marker="o", ms=3, lw=1.2, ls="-" if i != 2 else "--", label=label)
    for s in (SWITCH_TO_CPU, SWITCH_TO_GPU):
        ax.axvline(s + 0.5, color="k", lw=0.8, ls=":")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title(f"One run moved GPU → CPU → GPU by checkpoint ({result['device']})")
    ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="data/shakespeare")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--png", default="docs/hardware_switch.png")
    parser.add_argument("--plot-only", default=None)
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads(Path(args.plot_only).read_text()), Path(args.png))
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU")
    device = torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory() as tmp:
        ref_dir, sw_dir = Path(tmp) / "reference", Path(tmp) / "switched"
        train(ref_dir, args.data, "--device", "gpu")
        train(sw_dir, args.data, "--device", "gpu", "--train.stop_at_step", str(SWITCH_TO_CPU))
        train(sw_dir, args.data, "--device", "cpu", "--train.stop_at_step", str(SWITCH_TO_GPU), "--resume")
        train(sw_dir, args.data, "--device", "gpu", "--resume")
        ref, sw = step_losses(ref_dir), step_losses(sw_dir)
    diff = {s: sw[s] - ref[s] for s in sorted(sw)}
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": device,
        "torch": torch.__version__,
        "segments": {
            "gpu": [1, SWITCH_TO_CPU],
            "cpu": [SWITCH_TO_CPU + 1, SWITCH_TO_GPU],
            "gpu2": [SWITCH_TO_GPU + 1, STEPS],
        },
        "uninterrupted": ref,
        "switched": sw,
        "diff_first_cpu_step": diff[SWITCH_TO_CPU + 1],
        "diff_first_gpu_step_after_cpu": diff[SWITCH_TO_GPU + 1],
        "max_abs_diff_gpu_segment_before_switch": max(abs(diff[s]) for s in range(1, SWITCH_TO_CPU + 1)),
        "max_abs_diff_after_switches": max(abs(d) for s, d in diff.items() if s > SWITCH_TO_CPU),
        "final_loss_switched": sw[STEPS],
        "final_loss_uninterrupted": ref[STEPS],
    }
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"hardware_switch_{slug}.json").write_text(json.dumps(result, indent=1))
    print(f"{'step':>5} {'uninterrupted':>14} {'switched':>10} {'diff':>10}")
    for s in sorted(sw):
        mark = " <- switch" if s in (SWITCH_TO_CPU + 1, SWITCH_TO_GPU + 1) else ""
        print(f"{s:>5} {ref[s]:>14.5f} {sw[s]:>10.5f} {diff[s]:>+10.5f}{mark}")
    try:
        plot(result, Path(args.png))
    except ImportError:
        print("matplotlib missing: no PNG (use --plot-only on the results JSON)")


if __name__ == "__main__":
    main()
