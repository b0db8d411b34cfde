"""The doctor's report as text (rank 0 prints it; the same data goes to the JSON)."""

from __future__ import annotations

from anytrain.doctor.collectives import bus_factor

MATRIX_MAX_RANKS = 16  # larger jobs print the worst pairs instead of the whole matrix


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


def print_report(report: dict) -> None:
    _print_inventory(report)
    _print_gemm(report)
    coll = report.get("collectives")
    if coll:
        _print_functional(report["functional"])
        ok = "ok" if coll["all_reduce_correct"] else "WRONG SUM on at least one rank"
        print(f"all_reduce over {coll['world_size']} ranks ({coll['backend']}): {ok}")
        for name, rows in [("all_reduce", coll["sweep"]), *report.get("sweeps", {}).items()]:
            print(f"{name} (busbw = algbw x {bus_factor(name, coll['world_size']):.3g})")
            print(f"{'size':>10} {'time ms':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}")
            for row in rows:
                print(f"{human_bytes(row['bytes']):>10} {1e3 * row['seconds']:>10.3f} {row['algbw_gb_per_s']:>11.2f} "
                      f"{row['busbw_gb_per_s']:>11.2f}")  # fmt: skip
    if report.get("p2p"):
        _print_p2p(report["p2p"])
    part = report["data_partition"]
    print(f"data partition: steps {', '.join(map(str, part['steps']))} over {part['ranks']} rank(s) checked")
    if report.get("training"):
        _print_training(report["training"])
    for line in report["failures"]:
        print(f"FAILED {line}")


def _print_inventory(report: dict) -> None:
    hw, hosts = report["hardware"], report["hosts"]
    print(f"device: {hw['device']} ({hw['vendor']}), torch {hw['torch']}, cuda {hw['cuda']}, hip {hw['hip']}, "
          f"driver {hosts[0].get('driver')}, triton {hw['triton']}")  # fmt: skip
    launch = report["launch"]
    names = sorted({h["host"] for h in hosts})
    print(f"launcher: {launch['launcher']}, {launch['world_size']} rank(s) on {len(names)} host(s): "
          f"{', '.join(names[:8])}{' ...' if len(names) > 8 else ''}")  # fmt: skip
    if report["slurm"]:
        s = report["slurm"]
        print(f"slurm: job {s['job_id']} on {s['nodelist']} ({s['nodes']} node(s), {s['tasks']} task(s))")
    up = [f"{n['name']}{' ' + str(n['speed_mbps']) + 'Mb/s' if n['speed_mbps'] else ''}" for n in report["network"]
          if n["state"] in ("up", "rdma", "unknown")]  # fmt: skip
    print(f"network: {', '.join(up) or 'no interface up besides loopback'}")
    env = report["collective_env"]
    print("collective environment (rank 0): " + (" ".join(f"{k}={v}" for k, v in env.items()) or "none set"))
    for rank, keys in report["collective_env_differs"].items():
        print(f"  rank {rank} differs in: {', '.join(keys)}")
    for topo in report["topology"]:
        if topo["output"]:
            print(f"topology of {topo['host']} ({topo['command']}):\n{topo['output']}")
        else:
            print(f"topology of {topo['host']}: {topo['reason']}")


def _print_gemm(report: dict) -> None:
    bad_gemm = sum(not g["ok"] for g in report["gemm"])
    print(f"gemm {report['gemm'][0]['dtype']} vs float64: {'ok' if not bad_gemm else f'WRONG on {bad_gemm} rank(s)'}")
    rates = report["gemm_throughput"]
    first = rates[0]
    line = (f"gemm throughput {first['shape']}^3 {first['dtype']}: min {min(r['tflops'] for r in rates):.3g}, "
            f"max {max(r['tflops'] for r in rates):.3g} TFLOP/s over {len(rates)} rank(s)")  # fmt: skip
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
    """nccl-tests' ``#wrong`` column: one row per collective, one column per rank."""
    ranks = len(functional)
    print(f"{'#wrong':<16}" + "".join(f"{'rank ' + str(r):>8}" for r in range(ranks)))
    for i, row in enumerate(functional[0]):
        cells = ["err" if functional[r][i]["error"] else str(functional[r][i]["wrong"]) for r in range(ranks)]
        print(f"{row['name']:<16}" + "".join(f"{cell:>8}" for cell in cells))


def _print_p2p(p2p: dict) -> None:
    world = len(p2p["latency_us"])
    for key, title, fmt in (("latency_us", f"p2p latency, us ({human_bytes(p2p['small_bytes'])})", ".1f"),
                            ("bandwidth_gb_per_s", f"p2p bandwidth, GB/s ({human_bytes(p2p['large_bytes'])})",
                             ".2f")):  # fmt: skip
        matrix = p2p[key]
        if world <= MATRIX_MAX_RANKS:
            print(f"{title}: row = sender, column = receiver")
            print(f"{'':>6}" + "".join(f"{dst:>9}" for dst in range(world)))
            for src, row in enumerate(matrix):
                print(f"{src:>6}" + "".join(f"{'-' if v is None else format(v, fmt):>9}" for v in row))
        else:
            cells = [(v, s, d) for s, row in enumerate(matrix) for d, v in enumerate(row) if v is not None]
            worst = sorted(cells, reverse=key == "latency_us")[:5]
            print(f"{title}, worst pairs: " + ", ".join(f"{s}->{d} {format(v, fmt)}" for v, s, d in worst))


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
        what = kill["error"] or (f"SIGKILLed after the step-{kill['killed_at_step']} checkpoint, resumed to step "
                                 f"{steps}: loss {kill['losses'].get(steps, float('nan')):.4f}")  # fmt: skip
        print(f"checkpoint kill-restart: {what}")
