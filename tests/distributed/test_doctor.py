"""anytrain doctor over 2 real gloo ranks: one quick-suite run shared by the checks of its report, and (slow) the
full suite with its tiny trainings and the checkpoint kill-restart."""

import json

import pytest

from tests.conftest import run_cli


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("doctor") / "doctor.json"
    proc = run_cli(
        "doctor",
        "--suite",
        "quick",
        "--json",
        str(out),
        "--max-mib",
        "1",
        "--repeats",
        "2",
        "--expect-gpus",
        "0",
        "--expect-nodes",
        "1",
        nproc=2,
        NCCL_DEBUG="WARN",
    )
    return proc, json.loads(out.read_text()) if out.is_file() else None


def test_quick_suite_passes_on_two_ranks(quick):
    proc, report = quick
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert report["failures"] == []
    coll = report["collectives"]
    assert coll["world_size"] == 2 and coll["backend"] == "gloo" and coll["all_reduce_correct"]
    assert [row["bytes"] for row in coll["sweep"]] == [8 * 2**i for i in range(18)]  # 8 B ... 1 MiB
    assert all(row["busbw_gb_per_s"] == row["algbw_gb_per_s"] for row in coll["sweep"])  # 2(n-1)/n = 1 at n=2
    assert "all_reduce over 2 ranks (gloo): ok" in proc.stdout
    lines = [line.split() for line in proc.stdout.splitlines()]
    assert ["size", "time", "ms", "algbw", "GB/s", "busbw", "GB/s"] in lines  # the sweep table
    assert sum(line[:1] == ["8B"] for line in lines) == 1 and sum(line[:1] == ["1MiB"] for line in lines) == 1
    assert {row["status"] for row in report["summary"]} == {"ok", "not checked", "skipped"}  # nothing failed
    assert "FAILED" not in proc.stdout and "summary: " in proc.stdout


def test_report_lists_collective_variables_and_topology(quick):
    proc, report = quick
    env = report["collective_env"]
    assert env["NCCL_DEBUG"] == "WARN" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # ours, and the default set
    assert report["collective_env_differs"] == {}
    assert "NCCL_DEBUG=WARN" in proc.stdout
    assert [t["reason"] for t in report["topology"]] == ["no GPU: nothing to show"]  # one host, CPU


def test_p2p_matrix_and_gemm_throughput(quick):
    _, report = quick
    p2p = report["p2p"]
    assert p2p["small_bytes"] == 8 and p2p["large_bytes"] == 2**20
    for key in ("latency_us", "bandwidth_gb_per_s"):
        assert p2p[key][0][0] is None and p2p[key][1][1] is None
        assert p2p[key][0][1] > 0 and p2p[key][1][0] > 0
    for row in report["gemm_throughput"]:
        assert row["tflops"] > 0 and row["fraction"] is None and row["skipped"].startswith("CPU")
    assert report["data_partition"] == {"steps": [0, 1, 1044], "ranks": 2}


@pytest.mark.slow
def test_full_suite_trains_kills_and_resumes(tmp_path):
    """The full suite on 2 ranks, with a loss-drop threshold no 20-step run meets: every other check passes, the
    training checks fail naming the threshold, and the exit is non-zero."""
    out = tmp_path / "doctor.json"
    proc = run_cli(
        "doctor",
        "--json",
        str(out),
        "--max-mib",
        "1",
        "--min-bytes",
        "1048576",
        "--repeats",
        "2",
        "--work-dir",
        str(tmp_path / "work"),
        "--threshold",
        "min_loss_drop=0.99",
        nproc=2,
    )
    report = json.loads(out.read_text())
    assert proc.returncode != 0
    assert len(report["failures"]) == 3, report["failures"]
    assert all("(min_loss_drop)" in line for line in report["failures"])
    assert {line.split(": ")[1] for line in report["failures"]} == {"training (one device)", "training (all ranks)"}
    training = report["training"]
    alone = [run["losses"] for run in training["one_device"]]
    assert alone[0] == alone[1] and len(alone[0]) == 20 and alone[0]["20"] < alone[0]["1"]
    ranks = training["all_ranks"]
    assert ranks[0]["fingerprint"] == ranks[1]["fingerprint"]
    mean = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)]
    assert max(abs(m - alone[0][str(i + 1)]) for i, m in enumerate(mean)) < 1e-4
    kill = training["one_device"][0]["kill_restart"]
    assert kill["exit_code"] == -9 and kill["error"] is None
    assert max(abs(kill["losses"][s] - alone[0][s]) for s in alone[0]) < 1e-6
    assert sorted(report["sweeps"]) == ["all_gather", "all_to_all", "broadcast", "reduce_scatter", "send_recv"]
    assert report["ceilings"]["copy_gb_per_s"] > 0
    assert "checkpoint kill-restart: SIGKILLed after the step-10 checkpoint" in proc.stdout
