"""bench/mamba2_train.py's CPU smoke run: the Mamba-2 and hybrid recipe rows train through the product's own
Trainer.train_step at the debug flavours, with the recipe's activation checkpointing; ``--profile`` adds one profiled
step to the row it names."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT, cli_env


def test_mamba2_train_bench_smoke_rows_drive_the_trainer(tmp_path):
    rows = ["mamba2-1.3b", "hybrid-1.2b"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.mamba2_train",
            "--smoke",
            "--in-process",
            "--rows",
            *rows,
            "--profile",
            "mamba2-1.3b",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads((tmp_path / "mamba2_train_smoke.json").read_text())["rows"]
    assert [r["row"] for r in got] == rows
    for r in got:
        assert "error" not in r and r["driver"] == "Trainer.train_step" and r["tokens_per_s"] > 0, r
        assert (r["flavour"], r["activation_checkpointing"], r["recipe"]) == (
            "debug",
            "full",
            f"configs/{r['row']}.yaml",
        )
    assert [r["arch"] for r in got] == ["mamba2", "hybrid"]
    # --profile: one more step of the named row under torch.profiler (operators on CPU), the others untouched
    profile = got[0]["kernel_profile"]
    assert profile["kernel_ms"] > 0 and profile["top"] and "kernel_profile" not in got[1]
    assert "profile of one step of mamba2-1.3b" in proc.stdout
