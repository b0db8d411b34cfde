"""anytrain doctor's checks: nccl-tests bus factors, the sweep's message sizes, expectations, thresholds, the p2p
schedule, the partition and training comparisons, the report's tables and summary (a made-up report, small and beyond
16 ranks), and planted faults over 2 real gloo ranks (``ANYTRAIN_TEST_CORRUPT_RANK``, ``ANYTRAIN_TEST_OVERLAP_RANK``
and thresholds no machine meets) that must each fail, naming the rank and check."""

import itertools
import json

import pytest
import torch

from anytrain import hardware
from anytrain.doctor.checks import check_failures, expectation_failures, training_failures
from anytrain.doctor.collectives import bus_factor, message_numels
from anytrain.doctor.inventory import collective_env, gemm_check, network_interfaces, slurm_allocation
from anytrain.doctor.p2p import round_robin
from anytrain.doctor.report import failure_check, print_report, rank_ranges, summarize
from anytrain.doctor.smoke import partition_failures
from anytrain.doctor.suite import sweep_sizes
from anytrain.doctor.thresholds import Thresholds, load_thresholds
from anytrain.errors import ConfigError
from tests.conftest import cli_in_process, run_cli


@pytest.mark.parametrize(
    "name, world, factor",
    [
        ("all_reduce", 8, 1.75),
        ("all_gather", 8, 0.875),
        ("reduce_scatter", 4, 0.75),
        ("all_to_all", 2, 0.5),
        ("broadcast", 8, 1.0),
        ("send_recv", 8, 1.0),
    ],
)
def test_bus_factors_are_nccl_tests(name, world, factor):
    assert bus_factor(name, world) == factor


def test_sweep_sizes_appear_once_after_rounding():
    sizes = sweep_sizes(8, 1)  # 8 B ... 1 MiB
    assert message_numels("all_reduce", sizes, 2) == [2**i for i in range(1, 19)]
    assert message_numels("all_reduce", sizes, 4) == [2**i for i in range(2, 19)]  # 8 B and 16 B: 4 elements once
    numels = message_numels("all_gather", sizes, 3)  # whole multiples of the world size
    assert numels[:4] == [3, 6, 15, 30] and numels == sorted(set(numels)) and all(n % 3 == 0 for n in numels)
    assert message_numels("broadcast", sweep_sizes(1, 1)[:4], 8) == [8]  # 1, 2, 4, 8 B: one element per rank


def test_expectations_and_failures_name_the_rank_and_check():
    hosts = [{"host": "a", "gpus_visible": 8}, {"host": "b", "gpus_visible": 7}]
    assert expectation_failures(hosts, None, 2) == []
    assert expectation_failures(hosts, 8, 3) == [
        "rank 1 (b): inventory: 7 GPUs visible, expected 8 per node",
        "rank 0 (a): inventory: ranks run on 2 node(s) (a, b), expected 3",
    ]
    assert expectation_failures(hosts, 8, None) == ["rank 1 (b): inventory: 7 GPUs visible, expected 8 per node"]
    gemms = [{"ok": True}, {"ok": False, "finite": False, "dtype": "bfloat16", "shape": 512}]
    functional = [
        [{"name": "all_reduce", "wrong": 0, "error": None, "elements": 9}],
        [{"name": "all_reduce", "wrong": 2, "error": None, "elements": 9}],
    ]
    assert check_failures(hosts, gemms, functional) == [
        "rank 1 (b): gemm bfloat16 512^3: non-finite output",
        "rank 1 (b): all_reduce: #wrong 2 of 9 elements",
    ]


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
    for path, flags, message in [
        (None, ["busbw=1"], "unknown threshold 'busbw'; known: busbw_min_gb_per_s"),
        (None, ["loss_rtol"], "expected NAME=VALUE"),
        (None, ["loss_rtol=-1"], "must be >= 0"),
        (None, ["loss_rtol=x"], "must be a number"),
        (str(tmp_path / "none.yaml"), [], "none.yaml not found"),
    ]:
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
    training = {
        "one_device": [{**run, "kill_restart": {"error": None, "losses": resumed}}, run],
        "all_ranks": [
            {"losses": list(curve.values()), "fingerprint": [1.0, 2.0], "ids": {0: [1]}},
            {"losses": list(curve.values()), "fingerprint": [1.0, 2.5], "ids": {0: [2]}},
        ],
        "global_ids": {0: [1, 2]},
    }
    assert training_failures(hosts, training, Thresholds()) == [
        "rank 1 (b): training (all ranks): parameters differ from rank 0's after 20 steps (the replicas diverged)",
        "rank 0 (a): checkpoint kill-restart: resumed run against the uninterrupted one: step 15 loss 4.545 vs 4.5: "
        "relative difference 1.00e-02 > 0.001 (resume_rtol)",
    ]


def _made_up_report(world: int, failures: list[str]) -> dict:
    """A report of ``world`` ranks on hosts of 8 ranks, as run_doctor writes it (quick suite, no trainings)."""
    hosts = [{"host": f"node{r // 8}", "device": "GPU [x]", "gpus_visible": 8} for r in range(world)]
    sweep = [
        {"bytes": 2**i, "seconds": 1e-4 * i, "algbw_gb_per_s": 0.5 * i, "busbw_gb_per_s": 0.75 * i} for i in range(3, 6)
    ]
    functional = [
        [
            {"name": name, "elements": 4096, "wrong": int(name == "all_reduce" and r == 1), "error": None}
            for name in ("all_reduce", "send_recv")
        ]
        for r in range(world)
    ]
    latency = [[None if s == d else 10.0 + s + d for d in range(world)] for s in range(world)]
    report = {
        "suite": "quick",
        "hosts": hosts,
        "slurm": None,
        "network": [],
        "collective_env": {},
        "collective_env_differs": {},
        "topology": [],
        "launch": {"launcher": "srun", "world_size": world},
        "hardware": {"device": "GPU", "vendor": "cuda", "torch": "2", "cuda": "13", "hip": None, "triton": "3"},
        "gemm": [{"dtype": "bfloat16", "shape": 512, "finite": True, "max_rel_error": 2e-3, "ok": True}] * world,
        "gemm_throughput": [
            {
                "dtype": "bfloat16",
                "shape": 4096,
                "tflops": 700.0 + r,
                "peak_tflops": 989.0,
                "fraction": (700.0 + r) / 989,
                "skipped": None,
            }
            for r in range(world)
        ],
        "thresholds": {**Thresholds().__dict__, "p2p_latency_max_us": 30.0},
        "functional": functional,
        "collectives": {"world_size": world, "backend": "nccl", "all_reduce_correct": False, "sweep": sweep},
        "p2p": {"small_bytes": 8, "large_bytes": 2**26, "latency_us": latency, "bandwidth_gb_per_s": latency},
        "data_partition": {"steps": [0, 1, 9], "ranks": world},
        "expectations": {"gpus_per_node": 8, "nodes": None},
        "failures": failures,
    }
    report["summary"] = summarize(report)
    return report


def test_report_tables_and_summary_as_plain_text(capsys):
    failures = [
        "rank 1 (node0): all_reduce: #wrong 1 of 4096 elements",
        "rank 2 (node0): p2p to rank 3 (node0): latency 35.0 us > 30 us (p2p_latency_max_us)",
        "rank 9 (node1): gemm bfloat16 512^3: non-finite output",
        "rank 0 (node0): odd: something",
    ]
    assert [failure_check(line) for line in failures] == [
        ("all_reduce", [1]),
        ("p2p latency", [2, 3]),
        ("gemm vs float64", [9]),
        ("odd", [0]),
    ]
    assert rank_ranges([7, 0, 1, 2, 5, 8]) == "0-2, 5, 7-8" and rank_ranges([]) == ""
    for world in (4, 20):
        report = _made_up_report(world, failures[:1] if world == 4 else failures)
        print_report(report)
        out = capsys.readouterr().out
        assert "\x1b" not in out and "[x]" in out  # no colour codes into a pipe; brackets are text, not markup
        lines = out.splitlines()
        assert max(len(line) for line in lines if "─" in line) <= 100  # the tables' rules: no table wider
        assert not any(line.endswith(" ") for line in lines)
        rows = {row["check"]: row for row in report["summary"]}
        assert rows["all_reduce"]["status"] == "FAIL" and rows["all_reduce"]["ranks"] == [1]
        assert rows["inventory"]["note"] == "expected 8 GPUs per node"
        assert rows["all_reduce busbw"]["status"] == "not checked" and rows["send_recv"]["status"] == "ok"
        assert "FAILED rank 1 (node0): all_reduce: #wrong 1 of 4096 elements" in lines
        summary_row = next(line for line in lines if line.startswith("all_reduce  ") and "FAIL" in line)
        assert summary_row.split()[:3] == ["all_reduce", "FAIL", "1"]  # the summary row names the failing rank
        assert sum(line.split()[:1] == ["32B"] for line in lines) == 1  # the sweep: one row per size
        if world == 4:
            assert ["all_reduce", "0", "1", "0", "0"] in [line.split() for line in lines]  # #wrong per rank
            assert ["1", "11.0", "-", "13.0", "14.0"] in [line.split() for line in lines]  # latency, sender 1
            assert len(report["summary"]) == 9 and rows["p2p latency"]["status"] == "ok"
        else:  # per host rows, #wrong totals, worst pairs
            assert any(line.split()[:3] == ["8-15", "node1", "GPU"] for line in lines)
            assert ["all_reduce", "1", "1", "-"] in [line.split() for line in lines]
            assert ["19", "18", "47.0"] in [line.split() for line in lines] and "the 5 worst pairs" in out
            assert rows["p2p latency"]["ranks"] == [2, 3] and rows["gemm vs float64"]["ranks"] == [9]
            assert rows["odd"] == {"check": "odd", "status": "FAIL", "ranks": [0], "failures": 1, "note": ""}


def test_planted_faults_and_unmet_thresholds_fail_naming_rank_and_check(tmp_path):
    out = tmp_path / "doctor.json"
    (tmp_path / "thresholds.json").write_text(json.dumps({"busbw_min_gb_per_s": 1e6}))
    proc = run_cli(
        "doctor",
        "--suite",
        "quick",
        "--json",
        str(out),
        "--max-mib",
        "1",
        "--min-bytes",
        "1048576",
        "--repeats",
        "2",
        "--thresholds",
        str(tmp_path / "thresholds.json"),
        "--threshold",
        "p2p_latency_max_us=0.001",
        nproc=2,
        ANYTRAIN_TEST_CORRUPT_RANK="1",
        ANYTRAIN_TEST_OVERLAP_RANK="1",
    )
    assert proc.returncode != 0
    report = json.loads(out.read_text())
    wrong = {
        row["name"]: [rows[i]["wrong"] for rows in report["functional"]]
        for i, row in enumerate(report["functional"][0])
    }
    assert wrong["all_reduce"] == [0, 1]  # only the corrupting rank sees it
    assert all(counts == [0, 0] for name, counts in wrong.items() if name != "all_reduce")
    failures = [line.split(": ", 1)[1] for line in report["failures"]]  # without "rank r (host): "
    assert failures[0] == "all_reduce: #wrong 1 of 4096 elements" and report["failures"][0].startswith("rank 1 (")
    partition = [line for line in report["failures"] if "data partition" in line]
    assert len(partition) == 6  # 3 steps x (rank 1 took rank 0's ids, rank 0's share of the batch on no rank)
    assert all(
        line.startswith("rank 1 (")
        and line.endswith("2 of its 2 sample ids are already on a lower rank")
        or line.startswith("rank 0 (")
        and line.endswith("2 of the 4 global-batch sample ids are on no rank")
        for line in partition
    )
    assert sum(line.endswith("(busbw_min_gb_per_s)") for line in failures) == 1
    p2p = [line for line in report["failures"] if line.endswith("(p2p_latency_max_us)")]
    assert len(p2p) == 2 and {line[:6] for line in p2p} == {"rank 0", "rank 1"}
    assert len(report["failures"]) == 1 + 6 + 1 + 2
    assert "error: doctor: 10 check(s) failed: rank 1 (" in proc.stderr
    lines = [line.split() for line in proc.stdout.splitlines()]
    assert ["all_reduce", "0", "1"] in lines  # the #wrong table, one column per rank
    assert ["all_reduce", "FAIL", "1", "exact", "result,", "4096", "elements"] in lines  # the summary table
    summary = {row["check"]: (row["status"], row["ranks"]) for row in report["summary"]}
    assert summary["all_reduce"] == ("FAIL", [1]) and summary["data partition"] == ("FAIL", [0, 1])
    assert summary["p2p latency"] == ("FAIL", [0, 1]) and summary["all_reduce busbw"] == ("FAIL", [0])
    assert summary["all_gather"] == ("ok", []) and summary["p2p bandwidth"] == ("not checked", [])
