"""``anytrain doctor``: validate a machine or cluster under any launcher (``doctor/``)."""

from __future__ import annotations

import typer

from anytrain.errors import AnytrainError


def doctor(
    out: str = typer.Option(None, "--json", "--out", help="Write the report as JSON here (rank 0)."),
    suite: str = typer.Option(
        "full",
        help="quick (inventory, GEMM, collectives, p2p, small sweep) or full (adds "
        "ceilings, every sweep to --max-mib, tiny trainings, checkpoint kill-restart).",
    ),
    expect_gpus: int = typer.Option(None, "--expect-gpus", help="GPUs every node must show (fail otherwise)."),
    expect_nodes: int = typer.Option(None, "--expect-nodes", help="Nodes the ranks must span (fail otherwise)."),
    min_bytes: int = typer.Option(8, "--min-bytes", help="Smallest message in the bandwidth sweeps, in bytes."),
    max_mib: int = typer.Option(1024, help="Largest message in the bandwidth sweeps, in MiB."),
    repeats: int = typer.Option(5, help="Timed repeats per size."),
    thresholds_file: str = typer.Option(None, "--thresholds", help="YAML or JSON mapping: threshold name -> value."),
    threshold: list[str] = typer.Option(
        [],
        "--threshold",
        metavar="NAME=VALUE",
        help="One threshold, e.g. busbw_min_gb_per_s=150 (repeatable; after the file)",
    ),
    work_dir: str = typer.Option(
        None,
        "--work-dir",
        help="Where the full suite's trainings write (default: a "
        "temporary folder); point it at the checkpoint file system to test that.",
    ),
) -> None:
    """Check hosts, devices, GEMMs, the collectives (exact values, #wrong per rank, busbw), every rank pair's links and,
    in the full suite, tiny trainings and a checkpoint kill-restart, under any launcher (torchrun, srun, mpirun);
    exits non-zero naming each failed rank and check (docs/cluster.md)."""
    from anytrain.doctor import run_doctor
    from anytrain.doctor.thresholds import load_thresholds

    thresholds = load_thresholds(thresholds_file, threshold)
    report = run_doctor(out, max_mib, repeats, suite, expect_gpus, expect_nodes, min_bytes, thresholds, work_dir)
    failures = report["failures"]
    if failures:
        more = f"; ... {len(failures) - 10} more in the report" if len(failures) > 10 else ""
        raise AnytrainError(f"doctor: {len(failures)} check(s) failed: " + "; ".join(failures[:10]) + more)


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)
