"""anytrain doctor's checks: nccl-tests bus factors, expectations, thresholds, the p2p schedule, the partition and
training comparisons, and planted faults over 2 real gloo ranks (``ANYTRAIN_TEST_CORRUPT_RANK``,
``ANYTRAIN_TEST_OVERLAP_RANK`` and thresholds no machine meets) that must each fail, naming the rank and check."""

import itertools
import json

import pytest
import torch

from anytrain import hardware
from anytrain.doctor import check_failures, expectation_failures, training_failures
from anytrain.doctor.collectives import bus_factor
from anytrain.doctor.inventory import collective_env, gemm_check, network_interfaces, slurm_allocation
from anytrain.doctor.p2p import round_robin
from anytrain.doctor.smoke import partition_failures
from anytrain.doctor.thresholds import Thresholds, load_thresholds
from anytrain.errors import ConfigError
from tests.conftest import cli_in_process, run_cli


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
    env = {"NCCL_IB_HCA": "mlx5", "RCCL_MSCCL_ENABLE": "0", "HIP_VISIBLE_DEVICES": "1", "PATH": "/bin", "NCCLX": "1"}
    assert collective_env(env) == {"HIP_VISIBLE_DEVICES": "1", "NCCL_IB_HCA": "mlx5", "RCCL_MSCCL_ENABLE": "0"}
    assert hardware.single_device_env(torch.device("cpu")) == {}


def test_thresholds_from_file_and_flags_and_their_errors(tmp_path):
    file = tmp_path / "t.yaml"
    file.write_text("busbw_min_gb_per_s: 150\ngemm_min_fraction: 0.5\n")
    th = load_thresholds(str(file), ["gemm_min_fraction=0.6", "p2p_latency_max_us = 30"])
    assert (th.busbw_min_gb_per_s, th.gemm_min_fraction, th.p2p_latency_max_us) == (150, 0.6, 30)
    assert th.loss_rtol == Thresholds().loss_rtol
    (tmp_path / "t.json").write_text(json.dumps({"resume_rtol": 0}))
    assert load_thresholds(str(tmp_path / "t.json")).resume_rtol == 0
    for path, flags, message in [(None, ["busbw=1"], "unknown threshold 'busbw'; known: busbw_min_gb_per_s"),
                                 (None, ["loss_rtol"], "expected NAME=VALUE"),
                                 (None, ["loss_rtol=-1"], "must be >= 0"),
                                 (None, ["loss_rtol=x"], "must be a number"),
                                 (str(tmp_path / "none.yaml"), [], "none.yaml not found")]:  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            load_thresholds(path, flags)


def test_bad_threshold_is_one_error_line(capsys):
    code, out, err = cli_in_process(capsys, "doctor", "--threshold", "p2p_latency=5")
    assert code == 2 and out == ""
    assert err.startswith("error: --threshold: unknown threshold 'p2p_latency'") and err.count("\n") == 1


@pytest.mark.parametrize("world", range(2, 10))
def test_round_robin_meets_every_pair_once_in_disjoint_rounds(world):
    rounds = round_robin(world)
    assert len(rounds) == world - 1 + world % 2
    for pairs in rounds:
        ranks = [r for pair in pairs for r in pair]
        assert len(ranks) == len(set(ranks))
    assert sorted(p for pairs in rounds for p in pairs) == list(itertools.combinations(range(world), 2))


def test_partition_counts_as_multisets():
    hosts = [{"host": "a"}, {"host": "b"}]
    assert partition_failures([{0: [5, 7]}, {0: [7, 9]}], {0: [5, 7, 7, 9]}, hosts) == []  # epoch wrap: 7 twice
    assert partition_failures([{0: [5, 7]}, {0: [5, 8]}], {0: [5, 7, 1, 9]}, hosts) == [
        "rank 1 (b): data partition: step 0: 1 of its 2 sample ids are already on a lower rank",
        "rank 1 (b): data partition: step 0: 1 of its 2 sample ids are not in the global batch",
        "rank 0 (a): data partition: step 0: 2 of the 4 global-batch sample ids are on no rank",
    ]


def test_training_comparisons_name_the_check():
    hosts = [{"host": "a"}, {"host": "b"}]
    curve = {s: 6.0 - 0.1 * s for s in range(1, 21)}
    resumed = {**curve, 15: curve[15] * 1.01}
    run = {"losses": curve, "error": None, "kill_restart": None}
    training = {"one_device": [{**run, "kill_restart": {"error": None, "losses": resumed}}, run],
                "all_ranks": [{"losses": list(curve.values()), "fingerprint": [1.0, 2.0], "ids": {0: [1]}},
                              {"losses": list(curve.values()), "fingerprint": [1.0, 2.5], "ids": {0: [2]}}],
                "global_ids": {0: [1, 2]}}  # fmt: skip
    assert training_failures(hosts, training, Thresholds()) == [
        "rank 1 (b): training (all ranks): parameters differ from rank 0's after 20 steps (the replicas diverged)",
        "rank 0 (a): checkpoint kill-restart: resumed run against the uninterrupted one: step 15 loss 4.545 vs 4.5: "
        "relative difference 1.00e-02 > 0.001 (resume_rtol)",
    ]


def test_planted_faults_and_unmet_thresholds_fail_naming_rank_and_check(tmp_path):
    out = tmp_path / "doctor.json"
    (tmp_path / "thresholds.json").write_text(json.dumps({"busbw_min_gb_per_s": 1e6}))
    proc = run_cli("doctor", "--suite", "quick", "--json", str(out), "--max-mib", "1", "--min-bytes", "1048576",
                   "--repeats", "2", "--thresholds", str(tmp_path / "thresholds.json"),
                   "--threshold", "p2p_latency_max_us=0.001", nproc=2, ANYTRAIN_TEST_CORRUPT_RANK="1",
                   ANYTRAIN_TEST_OVERLAP_RANK="1")  # fmt: skip
    assert proc.returncode != 0
    report = json.loads(out.read_text())
    wrong = {row["name"]: [rows[i]["wrong"] for rows in report["functional"]] for i, row in
             enumerate(report["functional"][0])}  # fmt: skip
    assert wrong["all_reduce"] == [0, 1]  # only the corrupting rank sees it
    assert all(counts == [0, 0] for name, counts in wrong.items() if name != "all_reduce")
    failures = [line.split(": ", 1)[1] for line in report["failures"]]  # without "rank r (host): "
    assert failures[0] == "all_reduce: #wrong 1 of 4096 elements" and report["failures"][0].startswith("rank 1 (")
    partition = [line for line in report["failures"] if "data partition" in line]
    assert len(partition) == 6  # 3 steps x (rank 1 took rank 0's ids, rank 0's share of the batch on no rank)
    assert all(line.startswith("rank 1 (") and line.endswith("2 of its 2 sample ids are already on a lower rank") or
               line.startswith("rank 0 (") and line.endswith("2 of the 4 global-batch sample ids are on no rank")
               for line in partition)  # fmt: skip
    assert sum(line.endswith("(busbw_min_gb_per_s)") for line in failures) == 1
    p2p = [line for line in report["failures"] if line.endswith("(p2p_latency_max_us)")]
    assert len(p2p) == 2 and {line[:6] for line in p2p} == {"rank 0", "rank 1"}
    assert len(report["failures"]) == 1 + 6 + 1 + 2
    assert "error: doctor: 10 check(s) failed: rank 1 (" in proc.stderr
    assert "all_reduce             0       1" in proc.stdout  # the #wrong table, one column per rank
