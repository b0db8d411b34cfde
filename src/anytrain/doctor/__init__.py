"""``anytrain doctor``: is this machine / cluster fit to train? Inventory, collectives, links, GEMMs and trainings.

Runs as one process or under any launcher (torchrun, srun, mpirun). Every rank reports its host and device
(``inventory``), the collective libraries' environment variables and, once per host, the GPU topology; checks a seeded
GEMM against a float64 reference and times a large one against the device's peak; checks the loader's data partition.
With several ranks it runs every collective once with exact expected values (``collectives.functional_checks``: a
``#wrong`` count per rank, as nccl-tests prints), sweeps them (algbw / busbw) and measures every ordered rank pair's
latency and bandwidth (``p2p``). The full suite adds device ceilings, the sweeps of every collective up to
``max_mib``, and the tiny trainings with a checkpoint killed and resumed (``smoke``). Rank 0 compares the inventory
with ``--expect-gpus`` (per node) and ``--expect-nodes`` and the measurements with the thresholds
(``thresholds.Thresholds``), prints the report (``report``: rich tables, a pass / fail summary of every check with
its failing ranks) and writes it as JSON. Any failure is listed as ``rank <r> (<host>): <check>: <what>``
(``checks``); the CLI then exits non-zero on every rank. ``suite.run_doctor`` runs it all.
"""

from anytrain.doctor.suite import run_doctor

__all__ = ["run_doctor"]
