"""The doctor's report as text (rank 0 prints it; the same data goes to the JSON).

Header lines (device, launcher, network, collective environment, topology) are plain text; the measurements are
``rich`` tables: inventory and GEMMs per rank (per host beyond ``MATRIX_MAX_RANKS`` ranks), the ``#wrong`` counts,
each bandwidth sweep, the p2p latency and bandwidth matrices (their worst pairs beyond ``MATRIX_MAX_RANKS``) and the
pass / fail summary (``summarize``: every check, its status and failing ranks), followed by one ``FAILED rank <r>
(<host>): <check>: <what>`` line per failure. On a terminal rich fits the tables to its width and may colour them;
into a file or a pipe they are plain box-drawing text, as wide as the widest table needs (at least ``MIN_WIDTH``),
never wrapped.
"""

from __future__ import annotations

import re
import sys

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from anytrain.doctor.collectives import bus_factor

MATRIX_MAX_RANKS = 16  # larger jobs print the worst pairs instead of the whole matrix, per host rows, #wrong totals
MIN_WIDTH = 100  # console width into files and pipes (wider where a table needs it)
WORST_PAIRS = 5

_FAILURE = re.compile(r"rank (\d+) \(.*?\): (.*)")
_P2P_PEER = re.compile(r"p2p to rank (\d+) ")
_ESCAPES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # nvidia-smi underlines its topology header, also into a pipe


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


def rank_ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    parts: list[str] = []
    values = sorted(set(ranks))
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ", ".join(parts)


def failure_check(line: str) -> tuple[str, list[int]]:
    """A failure line ``rank <r> (<host>): <check>: <what>`` -> (check, ranks involved). The GEMM check's name drops
    its dtype and shape; a p2p pair's line is ``p2p latency`` or ``p2p bandwidth`` with both ranks of the pair."""
    match = _FAILURE.fullmatch(line)
    if not match:
        return line.split(": ")[0], []
    rank, rest = int(match[1]), match[2]
    peer = _P2P_PEER.match(rest)
    if peer:
        kind = "latency" if rest.endswith("(p2p_latency_max_us)") else "bandwidth"
        return f"p2p {kind}", [rank, int(peer[1])]
    check = rest.split(": ")[0]
    if check.startswith("gemm ") and check != "gemm throughput":
        check = "gemm vs float64"
    return check, [rank]


def _checks_run(report: dict) -> list[tuple[str, str, str]]:
    """(check, status when nothing failed, note) for every check this report ran."""
    th = report["thresholds"]

    def threshold(name: str) -> tuple[str, str]:
        return ("ok", f"{name} {th[name]:g}") if th.get(name) else ("not checked", f"{name} = 0")

    expect = report.get("expectations") or {}
    wording = {"gpus_per_node": "{} GPUs per node", "nodes": "{} node(s)"}
    wanted = [wording[key].format(value) for key, value in expect.items() if value is not None]
    checks = [
        (
            "inventory",
            "ok" if wanted or not expect else "not checked",
            f"expected {', '.join(wanted)}" if wanted else "no --expect-gpus / --expect-nodes" if expect else "",
        ),
        ("gemm vs float64", "ok", f"{report['gemm'][0]['dtype']} {report['gemm'][0]['shape']}^3"),
    ]
    rates = report["gemm_throughput"]
    if th.get("gemm_min_fraction") and all(r["fraction"] is None for r in rates):
        checks.append(("gemm throughput", "skipped", rates[0]["skipped"] or "no peak for this device"))
    else:
        checks.append(("gemm throughput", *threshold("gemm_min_fraction")))
    if report.get("functional"):
        checks += [(row["name"], "ok", f"exact result, {row['elements']} elements") for row in report["functional"][0]]
    if report.get("collectives"):
        checks.append(("all_reduce busbw", *threshold("busbw_min_gb_per_s")))
    if report.get("p2p"):
        checks.append(("p2p latency", *threshold("p2p_latency_max_us")))
        checks.append(("p2p bandwidth", *threshold("p2p_bandwidth_min_gb_per_s")))
    checks.append(("data partition", "ok", f"steps {', '.join(map(str, report['data_partition']['steps']))}"))
    training = report.get("training")
    if training:
        checks.append(
            ("training (one device)", "ok", f"loss_rtol {th['loss_rtol']:g}, min_loss_drop {th['min_loss_drop']:g}")
        )
        if training["all_ranks"]:
            checks.append(("training (all ranks)", "ok", "mean loss, identical replicas"))
            checks.append(("training data partition", "ok", "sample ids of every step"))
        if training["one_device"][0]["kill_restart"]:
            checks.append(("checkpoint kill-restart", "ok", f"resume_rtol {th['resume_rtol']:g}"))
    return checks


def summarize(report: dict) -> list[dict]:
    """One row per check: {"check", "status" ("ok", "FAIL", "not checked" for a threshold of 0 or no expectation,
    "skipped"), "ranks" (the failing ranks, sorted), "failures" (how many lines), "note"}; a failure of a check not in
    the list adds its own row."""
    rows = {
        name: {"check": name, "status": status, "ranks": [], "failures": 0, "note": note}
        for name, status, note in _checks_run(report)
    }
    for line in report["failures"]:
        name, ranks = failure_check(line)
        row = rows.setdefault(name, {"check": name, "status": "ok", "ranks": [], "failures": 0, "note": ""})
        row["status"] = "FAIL"
        row["failures"] += 1
        row["ranks"] = sorted(set(row["ranks"]) | set(ranks))
    return list(rows.values())


def _table(*columns: str, left: int = 1) -> Table:
    """A table with a rule under its header and no frame; the first ``left`` columns left-justified (names), the
    others right-justified (numbers)."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i < left else "right", no_wrap=True)
    return table


def _show(table: Table, title: str = "") -> None:
    """Print ``title`` (one line, never wrapped) and ``table`` on stdout: at the terminal's width there, else plain
    text as wide as the table needs."""
    tty = sys.stdout.isatty()
    console = Console(color_system="auto" if tty else None, markup=False, emoji=False, highlight=False)
    print()
    if title:
        print(title)
    if tty:
        console.print(table)
        return
    console.width = max(MIN_WIDTH, console.measure(table, options=console.options.update_width(10**4)).maximum)
    with console.capture() as captured:
        console.print(table)
    print("\n".join(line.rstrip() for line in captured.get().splitlines()))


def print_report(report: dict) -> None:
    _print_inventory(report)
    _print_gemm(report)
    coll = report.get("collectives")
    if coll:
        _print_functional(report["functional"])
        ok = "ok" if coll["all_reduce_correct"] else "WRONG SUM on at least one rank"
        print(f"all_reduce over {coll['world_size']} ranks ({coll['backend']}): {ok}")
        for name, rows in [("all_reduce", coll["sweep"]), *report.get("sweeps", {}).items()]:
            table = _table("size", "time ms", "algbw GB/s", "busbw GB/s", left=0)
            for row in rows:
                table.add_row(
                    human_bytes(row["bytes"]),
                    f"{1e3 * row['seconds']:.3f}",
                    f"{row['algbw_gb_per_s']:.2f}",
                    f"{row['busbw_gb_per_s']:.2f}",
                )
            _show(
                table,
                f"{name} over {coll['world_size']} ranks (busbw = algbw x {bus_factor(name, coll['world_size']):.3g})",
            )
    if report.get("p2p"):
        _print_p2p(report["p2p"])
    part = report["data_partition"]
    print(f"data partition: steps {', '.join(map(str, part['steps']))} over {part['ranks']} rank(s) checked")
    if report.get("training"):
        _print_training(report["training"])
    _print_summary(report.get("summary") or summarize(report))
    for line in report["failures"]:
        print(f"FAILED {line}")


def _print_inventory(report: dict) -> None:
    hw, hosts = report["hardware"], report["hosts"]
    print(
        f"device: {hw['device']} ({hw['vendor']}), torch {hw['torch']}, cuda {hw['cuda']}, hip {hw['hip']}, "
        f"driver {hosts[0].get('driver')}, triton {hw['triton']}"
    )
    launch = report["launch"]
    names = sorted({h["host"] for h in hosts})
    print(
        f"launcher: {launch['launcher']}, {launch['world_size']} rank(s) on {len(names)} host(s): "
        f"{', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
    )
    if report["slurm"]:
        s = report["slurm"]
        print(f"slurm: job {s['job_id']} on {s['nodelist']} ({s['nodes']} node(s), {s['tasks']} task(s))")
    up = [
        f"{n['name']}{' ' + str(n['speed_mbps']) + 'Mb/s' if n['speed_mbps'] else ''}"
        for n in report["network"]
        if n["state"] in ("up", "rdma", "unknown")
    ]
    print(f"network: {', '.join(up) or 'no interface up besides loopback'}")
    env = report["collective_env"]
    print("collective environment (rank 0): " + (" ".join(f"{k}={v}" for k, v in env.items()) or "none set"))
    for rank, keys in report["collective_env_differs"].items():
        print(f"  rank {rank} differs in: {', '.join(keys)}")
    for topo in report["topology"]:
        if topo["output"]:
            output = topo["output"] if sys.stdout.isatty() else _ESCAPES.sub("", topo["output"])
            print(f"topology of {topo['host']} ({topo['command']}):\n{output}")
        else:
            print(f"topology of {topo['host']}: {topo['reason']}")


def _span(values: list[float], fmt: str) -> str:
    low, high = format(min(values), fmt), format(max(values), fmt)
    return low if low == high else f"{low}-{high}"


def _print_gemm(report: dict) -> None:
    """The inventory and GEMM table (one row per rank, per host beyond MATRIX_MAX_RANKS ranks) and the GEMM lines."""
    hosts, gemms, rates = report["hosts"], report["gemm"], report["gemm_throughput"]
    first, check = rates[0], gemms[0]
    peak = f"of {first['peak_tflops']:.0f} peak" if first["peak_tflops"] else "of peak"
    per_rank = len(hosts) <= MATRIX_MAX_RANKS
    table = _table(
        "rank" if per_rank else "ranks",
        "host",
        "device",
        "GPUs",
        f"gemm {check['shape']}^3 error",
        f"{first['dtype']} {first['shape']}^3 TFLOP/s",
        peak,
        left=3,
    )
    groups: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        groups.setdefault(str(rank) if per_rank else host["host"], []).append(rank)
    for ranks in groups.values():
        host = hosts[ranks[0]]
        errors = [gemms[r]["max_rel_error"] for r in ranks]
        bad = [r for r in ranks if not gemms[r]["ok"]]
        error = "non-finite" if any(not gemms[r]["finite"] for r in ranks) else format(max(errors), ".1e")
        fractions = [rates[r]["fraction"] for r in ranks if rates[r]["fraction"] is not None]
        table.add_row(
            rank_ranges(ranks),
            host["host"],
            host["device"],
            _span([hosts[r]["gpus_visible"] for r in ranks], "d"),
            f"{error} {'WRONG on ' + rank_ranges(bad) if bad else 'ok'}",
            _span([rates[r]["tflops"] for r in ranks], ".3g"),
            _span(fractions, ".2f") if fractions else "-",
        )
    _show(table, "inventory and GEMMs")
    bad_gemm = sum(not g["ok"] for g in gemms)
    print(f"gemm {check['dtype']} vs float64: {'ok' if not bad_gemm else f'WRONG on {bad_gemm} rank(s)'}")
    line = (
        f"gemm throughput {first['shape']}^3 {first['dtype']}: min {min(r['tflops'] for r in rates):.3g}, "
        f"max {max(r['tflops'] for r in rates):.3g} TFLOP/s over {len(rates)} rank(s)"
    )
    fractions = [r["fraction"] for r in rates if r["fraction"] is not None]
    if fractions:
        line += f"; {min(fractions):.2f}-{max(fractions):.2f} of the {first['peak_tflops']:.0f} TFLOP/s peak"
    elif first["skipped"]:
        line += f"; no threshold ({first['skipped']})"
    print(line)
    c = report.get("ceilings")
    if c:
        print(f"device copy: {c['copy_gb_per_s']:.1f} GB/s (read + write)")


def _print_functional(functional: list[list[dict]]) -> None:
    """nccl-tests' ``#wrong`` column: one row per collective, one column per rank (beyond MATRIX_MAX_RANKS ranks the
    total and the ranks with a wrong element or an error)."""
    ranks = len(functional)
    cell = [
        ["err" if functional[r][i]["error"] else str(functional[r][i]["wrong"]) for r in range(ranks)]
        for i in range(len(functional[0]))
    ]
    if ranks <= MATRIX_MAX_RANKS:
        table = _table("#wrong", *(f"rank {r}" for r in range(ranks)))
        for row, cells in zip(functional[0], cell, strict=True):
            table.add_row(row["name"], *cells)
    else:
        table = _table("#wrong", "total", "ranks wrong", "ranks with an error")
        for i, row in enumerate(functional[0]):
            rows = [functional[r][i] for r in range(ranks)]
            table.add_row(
                row["name"],
                str(sum(x["wrong"] for x in rows)),
                rank_ranges([r for r, x in enumerate(rows) if x["wrong"]]) or "-",
                rank_ranges([r for r, x in enumerate(rows) if x["error"]]) or "-",
            )
    _show(table, f"collectives on {functional[0][0]['elements']} elements, exact results:")


def _print_p2p(p2p: dict) -> None:
    world = len(p2p["latency_us"])
    for key, title, fmt in (
        ("latency_us", f"p2p latency, us ({human_bytes(p2p['small_bytes'])})", ".1f"),
        ("bandwidth_gb_per_s", f"p2p bandwidth, GB/s ({human_bytes(p2p['large_bytes'])})", ".2f"),
    ):
        matrix = p2p[key]
        if world <= MATRIX_MAX_RANKS:
            title += ": row = sender, column = receiver"
            table = _table("", *map(str, range(world)), left=0)
            for src, row in enumerate(matrix):
                table.add_row(str(src), *("-" if v is None else format(v, fmt) for v in row))
        else:
            cells = [(v, s, d) for s, row in enumerate(matrix) for d, v in enumerate(row) if v is not None]
            title += f", the {WORST_PAIRS} worst pairs"
            table = _table("sender", "receiver", key.split("_")[0], left=0)
            for v, s, d in sorted(cells, reverse=key == "latency_us")[:WORST_PAIRS]:
                table.add_row(str(s), str(d), format(v, fmt))
        _show(table, title)


def _print_training(training: dict) -> None:
    steps = training["steps"]
    for rank, run in enumerate(training["one_device"]):
        losses = run["losses"]
        text = run["error"] or f"loss {losses[1]:.4f} -> {losses[steps]:.4f}"
        print(f"training, one device, rank {rank}: {steps} steps: {text}")
    if training["all_ranks"]:
        runs = training["all_ranks"]
        mean = [sum(r["losses"][i] for r in runs) / len(runs) for i in (0, -1)]
        print(f"training, all {len(runs)} ranks: mean loss {mean[0]:.4f} -> {mean[1]:.4f}")
    kill = training["one_device"][0]["kill_restart"]
    if kill:
        what = kill["error"] or (
            f"SIGKILLed after the step-{kill['killed_at_step']} checkpoint, resumed to step "
            f"{steps}: loss {kill['losses'].get(steps, float('nan')):.4f}"
        )
        print(f"checkpoint kill-restart: {what}")


def _print_summary(rows: list[dict]) -> None:
    counts = {
        status: sum(row["status"] == status for row in rows) for status in ("ok", "FAIL", "not checked", "skipped")
    }
    title = "summary: " + ", ".join(f"{n} {status}" for status, n in counts.items() if n)
    table = _table("check", "status", "failing ranks", "note", left=4)
    for row in rows:
        style = {"ok": "green", "FAIL": "bold red"}.get(row["status"], "yellow")
        table.add_row(row["check"], Text(row["status"], style=style), rank_ranges(row["ranks"]) or "-", row["note"])
    _show(table, title)
