"""anytrain doctor over real gloo processes: all_reduce correctness and a bus-bandwidth sweep."""

import json
import subprocess
import sys

from tests.conftest import ROOT, cli_env


def test_doctor_two_processes(tmp_path):
    out = tmp_path / "doctor.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                           "anytrain", "doctor", "--out", str(out), "--max-mib", "2", "--repeats", "2"],
                          cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    coll = report["collectives"]
    assert coll["world_size"] == 2 and coll["backend"] == "gloo" and coll["all_reduce_correct"]
    assert [row["bytes"] for row in coll["sweep"]] == [2**20, 2**21]
    assert all(row["busbw_gb_per_s"] == row["algbw_gb_per_s"] for row in coll["sweep"])  # 2(n-1)/n = 1 at n=2
    assert report["ceilings"]["matmul_tflops"] > 0 and len(report["rank_devices"]) == 2
    assert "all_reduce over 2 ranks (gloo): ok" in proc.stdout
