"""Shared fixtures: small prepared datasets made from the embedded corpus (no downloads)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors only in the interpreter, and a @triton.jit function is an interpreted one only
    # if the variable is set when its module is imported. The model modules import triton indirectly (torch._dynamo),
    # so it must be set before any test module is collected; GPU sessions leave it unset (compiled kernels).
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER_COUNT", "").isdigit():
    # each pytest-xdist worker computes on its share of the cores: two workers of two threads each on the two-core CI
    # machine oversubscribe it, and OpenMP's waiting threads then slow both (tests/unit's trainings ~1.5x)
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def cli_env(gpu: bool = False, **extra: str) -> dict[str, str]:
    """Environment for subprocesses that run anytrain from this checkout (GPUs hidden unless ``gpu``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def run_cli(
    *args: str,
    cwd: Path | None = None,
    timeout: int = 600,
    gpu: bool = False,
    nproc: int = 1,
    torchrun: bool | None = None,
    **env: str,
) -> subprocess.CompletedProcess:
    """``anytrain ARGS`` in new processes (``nproc`` ranks, each with its own gloo process group) -> (returncode,
    stdout, stderr). CPU runs are forks of a pre-imported server (tests/forklaunch.py: the same CLI without the
    interpreter start-up); GPU runs, and by default several ranks with a fault-injection kill (a dead rank must take
    the others down, torchrun's job), start ``python -m anytrain`` / torchrun. ``torchrun=False``: such a kill in
    forked ranks too (forklaunch then stops the others as torchrun's agent would), for tests of what the checkpoint
    holds rather than of the agent."""
    environ = cli_env(gpu, **env)
    if torchrun is None:
        torchrun = nproc > 1 and bool(environ.get("ANYTRAIN_TEST_KILL_AT_STEP"))
    if not gpu and not torchrun:
        from tests import forklaunch

        return forklaunch.run(list(args), environ, cwd or ROOT, nproc=nproc, timeout=timeout)
    launcher = (
        ["-m", "anytrain"]
        if nproc == 1
        else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "anytrain"]
    )
    return subprocess.run(
        [sys.executable, *launcher, *args],
        cwd=cwd or ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def torchrun_ranks(
    script: str,
    data: Path,
    tmp: Path,
    steps: int,
    global_batch: int,
    parallel: str = "",
    nproc: int = 2,
    timeout: int = 300,
) -> list[dict]:
    """Run a test file as a job of ``nproc`` CPU (gloo) ranks with the arguments (config file, ``tmp``), launched as
    torchrun would (its launch variables; the ranks are forks of the pre-imported server, tests/forklaunch.py): the
    file's ``__main__`` trains in-process and ends with ``end_rank``. The config: the debug Transformer on ``data``,
    seq 32, micro-batch 2, fp32, ``steps`` steps of ``global_batch`` sequences, ``parallel`` (e.g. "strategy: fsdp").
    Returns each rank's ``tmp/rank<r>.json``."""
    import json

    from tests import forklaunch

    config = tmp / "config.yaml"
    config.write_text(f"""
model: {{arch: transformer, flavour: debug}}
data: {{path: {data}, seq_len: 32}}
train: {{steps: {steps}, global_batch: {global_batch}, micro_batch: 2, lr: 3.0e-3, warmup_steps: 1, dtype: fp32,
        eval_batches: 1}}
parallel: {{{parallel}}}
device: cpu
""")
    proc = forklaunch.run([str(config), str(tmp)], cli_env(), ROOT, nproc=nproc, timeout=timeout, main=script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(nproc)]


def end_rank(out: Path, result: dict) -> None:
    """A ``torchrun_ranks`` rank's end: write its result, wait for the others, destroy the process group and leave
    without interpreter teardown (a gloo worker thread still freeing a finished collective's tensors can need the GIL
    during Py_Finalize and abort the process: "terminate called without an active exception", ~1 run in 15)."""
    import json

    import torch.distributed as dist

    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def cli_in_process(capsys, *args: str) -> tuple[int, str, str]:
    """``anytrain ARGS`` in this process (no interpreter start-up): (exit code, stdout, stderr)."""
    from unittest import mock

    from anytrain import cli as anytrain_cli

    with mock.patch.object(sys, "argv", ["anytrain", *args]):
        try:
            anytrain_cli.main()
            code = 0
        except SystemExit as exc:
            code = exc.code or 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def autocast_block_outputs(models: dict, block_of, tokens) -> tuple[dict, dict, dict]:
    """For each named model: the output of its block ``block_of(model)`` and its mean next-token loss (as fp32) under
    CPU bf16 autocast, and the dtype of its logits without autocast — (block outputs, losses, plain dtypes). The
    residual-stream dtype tests of both model families."""
    block_out, losses, plain = {}, {}, {}
    for name, model in models.items():
        hook = block_of(model).register_forward_hook(lambda m, a, out, key=name: block_out.__setitem__(key, out))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses[name] = model(tokens, targets=tokens).float()
        hook.remove()
        plain[name] = model(tokens).dtype
    return block_out, losses, plain


def packed_documents(eos: int, lengths: tuple[int, ...], vocab: int = 512, seed: int = 0) -> list[torch.Tensor]:
    """Random documents of ``lengths`` tokens (ids 4..vocab-1), each followed by ``eos`` except the last, which runs
    off the row as a window's cut does: ``torch.cat(docs)[None]`` is the packed (1, T) row of the document tests."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(4, vocab, (n,), generator=gen) for n in lengths]
    return [torch.cat([d, torch.tensor([eos])]) for d in docs[:-1]] + [docs[-1]]


def split_documents(row: torch.Tensor, eos: int) -> list[torch.Tensor]:
    """A (T,) row's documents, each ending at (and including) an EOS; the last may have none."""
    ends = [i + 1 for i, t in enumerate(row.tolist()) if t == eos]
    return [row[a:b] for a, b in zip([0, *ends], [*ends, len(row)], strict=True) if b > a]


def _corpus_files(n: int) -> list[Path]:
    from anytrain.data.prepare import embedded_corpus_dir

    return sorted(embedded_corpus_dir().glob("*_gut.txt"))[:n]


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> Path:
    """Six plays, 512-token vocabulary: for the debug model in unit and multi-process tests."""
    from anytrain.data.prepare import prepare

    raw = tmp_path_factory.mktemp("raw")
    for file in _corpus_files(6):
        (raw / file.name).write_text(file.read_text(encoding="utf-8", errors="replace"))
    out = tmp_path_factory.mktemp("data") / "small"
    prepare([str(raw)], out, vocab_size=512, val_fraction=0.2)
    return out


@pytest.fixture(scope="session")
def shakespeare_data(tmp_path_factory) -> Path:
    """The full embedded corpus with the demo's 8k vocabulary (what configs/tiny.yaml trains on)."""
    from anytrain.data.prepare import prepare

    out = tmp_path_factory.mktemp("data") / "shakespeare"
    prepare(["shakespeare"], out, vocab_size=8192)
    return out


@pytest.fixture(autouse=True, scope="session")
def _fast_triton_interpreter():
    """Under TRITON_INTERPRET=1 (set above on machines without a GPU) every test of the session gets the interpreter's
    faster custom-combine reduce / scan (``tests/triton_interpreter.py``, bitwise the same)."""
    if os.environ.get("TRITON_INTERPRET") == "1" and "triton" in sys.modules:
        from tests import triton_interpreter

        triton_interpreter.install()
    yield


@pytest.fixture
def small_tmpfs(tmp_path):
    """``mount(size)`` -> a new folder under ``tmp_path`` with a tmpfs of ``size`` ("640k") mounted on it: a real
    filesystem that fills up. Unmounted after the test; the test is skipped where mounting is not allowed (not root)."""
    mounts: list[Path] = []

    def mount(size: str) -> Path:
        path = tmp_path / f"full{len(mounts) or ''}"
        path.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
        if proc.returncode:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounts.append(path)
        return path

    yield mount
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], check=True)
