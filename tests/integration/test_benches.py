"""The benches' CPU smoke modes: their anytrain rows must run the product's own Trainer.train_step (a bench that
silently fell back to other code, or broke when the trainer changed, would report numbers of something else)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT, cli_env


def _bench(tmp_path, script: str, flag: str) -> list[dict]:
    proc = subprocess.run([sys.executable, f"bench/{script}.py", flag, "--out", str(tmp_path)], cwd=ROOT,
                          env=cli_env(), capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob(f"{script}_*.json")
    return json.loads(path.read_text())["rows"]


def test_mamba_train_bench_drives_the_trainer(tmp_path):
    rows = [r for r in _bench(tmp_path, "mamba_train", "--quick") if not r.get("name", "").startswith("hf")]
    assert rows and all(r.get("driver") == "Trainer.train_step" and r.get("tokens_per_s", 0) > 0 for r in rows), rows


def test_transformer_bench_smoke_rows_run(tmp_path):
    rows = _bench(tmp_path, "transformer", "--smoke")
    assert rows and all(r.get("error") is None and r.get("tokens_per_s", 0) > 0 for r in rows), rows
