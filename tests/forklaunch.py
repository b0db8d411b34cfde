"""Run ``anytrain`` commands in processes forked from a pre-imported server: the real CLI, a real process per rank,
real gloo, without paying the interpreter + torch + anytrain import (~3-4 s of CPU per process on the CI machine)
for each of them.

A ``multiprocessing`` fork server started once per pytest worker imports the CLI and the trainer; each command is a
fork of it that takes the caller's environment, working directory and argv, sends its stdout/stderr to files, runs
``anytrain.cli.main`` and exits with its code. ``nproc`` > 1 starts one fork per rank with the plain-environment
launch variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), which
``anytrain.parallel.env`` reads like torchrun's. Tests of the launchers themselves (torchrun's agent, signals sent to
it, srun, mpirun) start those for real instead.
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_PRELOAD = [
    "torch",
    "torch.utils.tensorboard",
    "anytrain.cli",
    "anytrain.train.trainer",
    "anytrain.parallel.env",
    # what every command imported again in each fork (~0.25 s of a debug-model run's 1 s): typer's parameter
    # adapters (pydantic), the checkpoint and export modules, the tokenizer
    "typer._adapters",
    "typer._click.decorators",
    "rich._emoji_codes",
    "numpy.ma",
    "tokenizers",
    "safetensors.torch",
    "anytrain.checkpoint.export",
    "anytrain.checkpoint.run_model",
    "anytrain.evals",
]
_context = None


def _ctx():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def _child(argv: list[str], env: dict[str, str], cwd: str, out_path: str, err_path: str, main: str = "") -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if env.get("OMP_NUM_THREADS", "").isdigit():
        # torch sized its thread pool when the server imported it, from the server's environment: take the command's
        # OMP_NUM_THREADS as a new interpreter would (cli_env's 1; else every rank runs the cores' count of threads)
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # run() asks a hung rank for its threads' stacks
    code = 0
    try:
        if main:  # a script or ``-m`` module as ``__main__``: what ``python FILE ARGV`` / ``python -m M ARGV`` runs
            import runpy

            sys.argv = [main, *argv]
            if main.endswith(".py"):
                runpy.run_path(main, run_name="__main__")
            else:
                runpy.run_module(main, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["anytrain", *argv]
            from anytrain import cli

            cli.main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # an uncaught exception: traceback on stderr, exit 1 as the interpreter would
        import traceback

        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # multiprocessing ends its children with os._exit, which skips them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class RanksTimedOut(subprocess.TimeoutExpired):
    """A command whose ranks did not all exit in time; its message names the hung ranks and ends with each rank's
    last stderr lines: a hung rank's end with every thread's Python stack (where a flaky hang stood)."""

    def __init__(self, cmd, timeout, output, stderr, hung_ranks: list[int], tails: list[str]):
        super().__init__(cmd, timeout, output, stderr)
        self.hung_ranks, self.tails = hung_ranks, tails

    def __str__(self) -> str:
        parts = [f"{super().__str__()}; ranks still running: {self.hung_ranks}"]
        parts += [f"--- rank {r} stderr (last {len(tail):,} characters):\n{tail}" for r, tail in enumerate(self.tails)]
        return "\n".join(parts)


def _read(path: str) -> str:
    return Path(path).read_text(errors="replace") if os.path.exists(path) else ""


def _free_port() -> int:
    """A port for rank 0's TCPStore, from a range of its own per pytest-xdist worker, below Linux's ephemeral range: a
    port the kernel hands out for ``bind(0)`` is free only until it is bound, and two workers (or a torchrun
    ``--standalone`` of another test) asking at once could get the same one — one job's rank then joins the other's
    store and both wait until the test times out."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    low = 20_000 + 1_500 * (int(worker) % 8 if worker.isdigit() else 0)
    for port in random.Random().sample(range(low, low + 1_500), 50):  # its own generator: tests' seeds untouched
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


STOP_GRACE_S = 30.0
"""After a rank dies by a signal (a fault injection's SIGKILL), how long the others have between SIGTERM and SIGKILL:
what torchrun's agent does when a worker fails."""


def _wait(procs: list, timeout: float) -> None:
    """Wait until every process ended or ``timeout`` passed. Once one dies by a signal, the others are stopped as
    torchrun's agent stops the workers of a failed rank: SIGTERM, then SIGKILL after ``STOP_GRACE_S``."""
    from multiprocessing.connection import wait

    deadline, kill_at = time.monotonic() + timeout, None
    while True:
        alive = [p for p in procs if p.exitcode is None]
        now = time.monotonic()
        if not alive or now >= deadline:
            return
        if kill_at is None and any(p.exitcode is not None and p.exitcode < 0 for p in procs):
            for proc in alive:
                os.kill(proc.pid, signal.SIGTERM)
            kill_at = now + STOP_GRACE_S
        elif kill_at is not None and now >= kill_at:
            for proc in alive:
                proc.kill()
        wait([p.sentinel for p in alive], timeout=max(0.05, min(deadline, kill_at or deadline) - now))


def run(argv: list[str], env: dict[str, str], cwd: Path, nproc: int = 1, timeout: float = 300, main: str = ""):
    """``anytrain ARGV`` (one process, or ``nproc`` ranks) -> CompletedProcess. With several ranks, stdout/stderr are
    the ranks' in rank order and the return code is 0 when every rank exited 0, else 1 (as torchrun reports); a rank
    that dies by a signal gets the others stopped as torchrun's agent would (``_wait``).
    ``main``: run that script (a ``.py`` path) or module (``bench.tp_optimizer``) with ARGV instead of the CLI, as
    ``torchrun --nproc-per-node NPROC MAIN ARGV`` would (the launch variables above, not torchrun's agent)."""
    ctx = _ctx()
    port = _free_port()
    procs, files = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for rank in range(nproc):
            rank_env = dict(env)
            if nproc > 1:
                ranks = dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=nproc, LOCAL_WORLD_SIZE=nproc, MASTER_PORT=port)
                rank_env.update({key: str(value) for key, value in ranks.items()}, MASTER_ADDR="127.0.0.1")
            out, err = f"{tmp}/out{rank}", f"{tmp}/err{rank}"
            proc = ctx.Process(target=_child, args=(list(argv), rank_env, str(cwd), out, err, str(main)))
            proc.start()
            procs.append(proc)
            files.append((out, err))
        _wait(procs, timeout)
        hung = [p for p in procs if p.exitcode is None]
        for proc in hung:  # each hung rank writes every thread's Python stack to its stderr file first
            os.kill(proc.pid, signal.SIGUSR1)
        if hung:
            time.sleep(2.0)
        for proc in hung:
            proc.kill()
            proc.join()
        stdout = "".join(_read(out) for out, _ in files)
        errors = [_read(err) for _, err in files]
        stderr = "".join(errors)
        tails = [text[-(8000 if proc in hung else 1500) :] for text, proc in zip(errors, procs, strict=True)]
    cmd = [str(main) or "anytrain", *argv]
    if hung:
        hung_ranks = [rank for rank, proc in enumerate(procs) if proc in hung]
        raise RanksTimedOut(cmd, timeout, stdout, stderr, hung_ranks, tails)
    codes = [p.exitcode for p in procs]
    code = codes[0] if nproc == 1 else (0 if not any(codes) else 1)
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)


class Forked:
    """One ``anytrain ARGV`` forked from the server and left running (``start``): the part of ``subprocess.Popen`` the
    signal tests use (pid, poll, wait, communicate, send_signal, kill, returncode), output in files as ``run``'s."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path):
        self._tmp = tempfile.TemporaryDirectory()
        self.stdout_path, self.stderr_path = f"{self._tmp.name}/out", f"{self._tmp.name}/err"
        args = (list(argv), dict(env), str(cwd), self.stdout_path, self.stderr_path)
        self._proc = _ctx().Process(target=_child, args=args)
        self._proc.start()
        self.pid, self.args = self._proc.pid, ["anytrain", *argv]

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def stderr_text(self) -> str:
        """What the command has written to stderr so far."""
        return _read(self.stderr_path)

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._proc.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return _read(self.stdout_path), _read(self.stderr_path)

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        self._proc.kill()
        self._proc.join()

    def __del__(self):
        self._tmp.cleanup()


def start(argv: list[str], env: dict[str, str], cwd: Path) -> Forked:
    """``anytrain ARGV`` forked from the pre-imported server, not waited for (one process)."""
    return Forked(argv, env, cwd)
