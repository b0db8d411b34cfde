"""anytrain doctor's checks: nccl-tests bus factors, expectations, and a planted fault over 2 real gloo ranks
(``ANYTRAIN_TEST_CORRUPT_RANK``) that must show as ``#wrong`` on that rank and a non-zero exit naming it."""

import json
import subprocess
import sys

import pytest
import torch

from anytrain.doctor import check_failures, expectation_failures
from anytrain.doctor.collectives import bus_factor
from anytrain.doctor.inventory import gemm_check, network_interfaces, slurm_allocation
from tests.conftest import ROOT, cli_env


@pytest.mark.parametrize("name, world, factor", [("all_reduce", 8, 1.75), ("all_gather", 8, 0.875),
                                                 ("reduce_scatter", 4, 0.75), ("all_to_all", 2, 0.5),
                                                 ("broadcast", 8, 1.0), ("send_recv", 8, 1.0)])  # fmt: skip
def test_bus_factors_are_nccl_tests(name, world, factor):
    assert bus_factor(name, world) == factor


def test_expectations_and_failures_name_the_rank_and_check():
    hosts = [{"host": "a", "gpus_visible": 8}, {"host": "b", "gpus_visible": 7}]
    assert expectation_failures(hosts, None, 2) == []
    assert expectation_failures(hosts, 8, 3) == [
        "rank 1 (b): inventory: 7 GPUs visible, expected 8 per node",
        "rank 0 (a): inventory: ranks run on 2 node(s) (a, b), expected 3",
    ]
    assert expectation_failures(hosts, 8, None) == ["rank 1 (b): inventory: 7 GPUs visible, expected 8 per node"]
    gemms = [{"ok": True}, {"ok": False, "finite": False, "dtype": "bfloat16", "shape": 512}]
    functional = [[{"name": "all_reduce", "wrong": 0, "error": None, "elements": 9}],
                  [{"name": "all_reduce", "wrong": 2, "error": None, "elements": 9}]]  # fmt: skip
    assert check_failures(hosts, gemms, functional) == ["rank 1 (b): gemm bfloat16 512^3: non-finite output",
                                                        "rank 1 (b): all_reduce: #wrong 2 of 9 elements"]  # fmt: skip


def test_inventory_pieces_on_this_host():
    gemm = gemm_check(torch.device("cpu"), n=64)
    assert gemm["ok"] and gemm["finite"] and gemm["max_rel_error"] < 1e-5
    assert all(row["name"] != "lo" for row in network_interfaces())
    assert slurm_allocation({}) is None
    assert slurm_allocation({"SLURM_JOB_ID": "5", "SLURM_JOB_NUM_NODES": "2"})["nodes"] == "2"


def test_planted_all_reduce_fault_is_counted_and_fails_the_run(tmp_path):
    out = tmp_path / "doctor.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                           "anytrain", "doctor", "--suite", "quick", "--json", str(out), "--max-mib", "1",
                           "--repeats", "2", "--expect-gpus", "0", "--expect-nodes", "1"],
                          cwd=ROOT, env=cli_env(ANYTRAIN_TEST_CORRUPT_RANK="1"), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode != 0
    report = json.loads(out.read_text())
    wrong = {row["name"]: [rows[i]["wrong"] for rows in report["functional"]] for i, row in
             enumerate(report["functional"][0])}  # fmt: skip
    assert wrong["all_reduce"] == [0, 1]  # only the corrupting rank sees it
    assert all(counts == [0, 0] for name, counts in wrong.items() if name != "all_reduce")
    assert len(report["failures"]) == 1 and report["failures"][0].endswith("all_reduce: #wrong 1 of 4096 elements")
    assert report["failures"][0].startswith("rank 1 (")
    assert "error: doctor: 1 check(s) failed: rank 1 (" in proc.stderr
    assert "all_reduce             0       1" in proc.stdout  # the #wrong table, one column per rank
