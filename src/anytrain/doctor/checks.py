"""The doctor's verdicts: the report's inventory, checks, measurements and trainings against the expectations and
thresholds, as ``rank <r> (<host>): <check>: <what>`` lines (empty when everything passes)."""

from __future__ import annotations

from anytrain.doctor import smoke
from anytrain.doctor.thresholds import Thresholds


def expectation_failures(hosts: list[dict], expect_gpus: int | None, expect_nodes: int | None) -> list[str]:
    """Inventory against the expectations: one line per rank whose host shows another GPU count, and one line when
    the ranks span another number of hosts."""
    failures = []
    if expect_gpus is not None:
        for rank, host in enumerate(hosts):
            if host["gpus_visible"] != expect_gpus:
                failures.append(
                    f"rank {rank} ({host['host']}): inventory: {host['gpus_visible']} GPUs visible, "
                    f"expected {expect_gpus} per node"
                )
    names = sorted({host["host"] for host in hosts})
    if expect_nodes is not None and len(names) != expect_nodes:
        failures.append(
            f"rank 0 ({hosts[0]['host']}): inventory: ranks run on {len(names)} node(s) "
            f"({', '.join(names[:8])}), expected {expect_nodes}"
        )
    return failures


def check_failures(hosts: list[dict], gemms: list[dict], functional: list[list[dict]] | None) -> list[str]:
    """``rank <r> (<host>): <check>: <what>`` for every failed GEMM and collective check."""
    failures = []
    for rank, (host, gemm) in enumerate(zip(hosts, gemms, strict=True)):
        if not gemm["ok"]:
            what = "non-finite output" if not gemm["finite"] else f"max relative error {gemm['max_rel_error']:.2e}"
            failures.append(f"rank {rank} ({host['host']}): gemm {gemm['dtype']} {gemm['shape']}^3: {what}")
    for rank, rows in enumerate(functional or []):
        for row in rows:
            if row["error"]:
                failures.append(f"rank {rank} ({hosts[rank]['host']}): {row['name']}: {row['error']}")
            elif row["wrong"]:
                failures.append(
                    f"rank {rank} ({hosts[rank]['host']}): {row['name']}: #wrong {row['wrong']} of "
                    f"{row['elements']} elements"
                )
    return failures


def threshold_failures(report: dict, th: Thresholds) -> list[str]:
    """GEMM throughput, all_reduce busbw and p2p latency / bandwidth against the thresholds (0 = not checked)."""
    hosts, failures = report["hosts"], []
    name = [f"rank {r} ({h['host']})" for r, h in enumerate(hosts)]
    for rank, row in enumerate(report["gemm_throughput"]):
        if th.gemm_min_fraction and row["fraction"] is not None and row["fraction"] < th.gemm_min_fraction:
            failures.append(
                f"{name[rank]}: gemm throughput: {row['tflops']:.1f} TFLOP/s = {row['fraction']:.2f} of "
                f"the {row['peak_tflops']:.0f} TFLOP/s peak < {th.gemm_min_fraction:g} "
                "(gemm_min_fraction)"
            )
    coll = report.get("collectives")
    if coll and th.busbw_min_gb_per_s and coll["sweep"]:
        last = coll["sweep"][-1]
        if last["busbw_gb_per_s"] < th.busbw_min_gb_per_s:
            failures.append(
                f"{name[0]}: all_reduce busbw: {last['busbw_gb_per_s']:.2f} GB/s at {last['bytes']} B < "
                f"{th.busbw_min_gb_per_s:g} GB/s (busbw_min_gb_per_s)"
            )
    p2p = report.get("p2p")
    for src, row in enumerate(p2p["latency_us"] if p2p else []):
        for dst, latency in enumerate(row):
            bandwidth = p2p["bandwidth_gb_per_s"][src][dst]
            pair = f"{name[src]}: p2p to {name[dst]}"
            if latency is not None and th.p2p_latency_max_us and latency > th.p2p_latency_max_us:
                failures.append(f"{pair}: latency {latency:.1f} us > {th.p2p_latency_max_us:g} us (p2p_latency_max_us)")
            if bandwidth is not None and th.p2p_bandwidth_min_gb_per_s and bandwidth < th.p2p_bandwidth_min_gb_per_s:
                failures.append(
                    f"{pair}: bandwidth {bandwidth:.2f} GB/s < {th.p2p_bandwidth_min_gb_per_s:g} GB/s "
                    "(p2p_bandwidth_min_gb_per_s)"
                )
    return failures


def training_failures(hosts: list[dict], training: dict, th: Thresholds) -> list[str]:
    """The one-device runs (each against rank 0's), the all-rank run (mean loss against rank 0's one-device run,
    identical replicas, the ids it trained on) and the kill-restart (against the uninterrupted run)."""
    name = [f"rank {r} ({h['host']})" for r, h in enumerate(hosts)]
    steps, failures = smoke.SMOKE_STEPS, []
    runs, all_ranks = training["one_device"], training["all_ranks"]
    ref = smoke.as_list(runs[0]["losses"], steps) if runs[0]["losses"] else None
    for rank, run in enumerate(runs):
        if run["error"]:
            failures.append(f"{name[rank]}: training (one device): {run['error']}")
            continue
        losses = smoke.as_list(run["losses"], steps)
        problem = smoke.curve_problem(losses, th.min_loss_drop)
        if problem:
            failures.append(f"{name[rank]}: training (one device): {problem}")
        mismatch = smoke.loss_mismatch(losses, ref, th.loss_rtol) if rank and ref else None
        if mismatch:
            failures.append(f"{name[rank]}: training (one device): against rank 0's run: {mismatch} (loss_rtol)")
    if all_ranks:
        n = min(len(r["losses"]) for r in all_ranks)
        mean = [sum(r["losses"][i] for r in all_ranks) / len(all_ranks) for i in range(n)]
        problem = smoke.curve_problem(mean, th.min_loss_drop)
        if problem:
            failures.append(f"{name[0]}: training (all ranks): {problem}")
        mismatch = smoke.loss_mismatch(mean, ref, th.loss_rtol) if ref else None
        if mismatch:
            failures.append(
                f"{name[0]}: training (all ranks): mean loss against rank 0's one-device run: {mismatch} (loss_rtol)"
            )
        for rank, run in enumerate(all_ranks):
            if run["fingerprint"] != all_ranks[0]["fingerprint"]:
                failures.append(
                    f"{name[rank]}: training (all ranks): parameters differ from rank 0's after {n} steps "
                    "(the replicas diverged)"
                )
        failures += smoke.partition_failures(
            [r["ids"] for r in all_ranks], training["global_ids"], hosts, "training data partition"
        )
    kill = runs[0]["kill_restart"]
    if kill and kill["error"]:
        failures.append(f"{name[0]}: checkpoint kill-restart: {kill['error']}")
    elif kill and ref:
        mismatch = smoke.loss_mismatch(smoke.as_list(kill["losses"], steps), ref, th.resume_rtol)
        if mismatch:
            failures.append(
                f"{name[0]}: checkpoint kill-restart: resumed run against the uninterrupted one: "
                f"{mismatch} (resume_rtol)"
            )
    return failures
