"""``parallel.grad_compression`` on 2 gloo processes: bf16 / fp16 / PowerSGD train like the uncompressed run, the
bytes they report are what their all-reduces carry (half of fp32; PowerSGD's (n + m)·r per compressed matrix), a
resumed PowerSGD run is bitwise the uninterrupted one, ZeRO-1 reduces through the same hooks and FSDP2 through its
reduce dtype; PowerSGD's state survives DDP's bucket rebuild and a change of bucket layout; bad settings are one line.

The fixtures launch this file as 2 ranks (torchrun's launch variables, forks of tests/forklaunch.py's pre-imported
server); each rank trains the debug transformer once per case in one process group and writes what it measured to
``<out>/rank<r>.json`` (rank 0 also leaves each run's metrics.jsonl)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

STEPS = 20  # the default run; the slow test trains LONG_STEPS
LONG_STEPS = 200
RANK = 4
START = 10  # powersgd_start_step of the short runs (the long ones start at 50)
CUT = 15  # the resumed run stops here first
SAVE_FINAL = ("--checkpoint.save_final", "true")


def _config(tmp: Path, data: Path, steps: int) -> Path:
    config = tmp / f"gc{steps}.yaml"
    config.write_text(f"""
model: {{arch: transformer, flavour: debug}}
data: {{path: {data}, seq_len: 32}}
train: {{steps: {steps}, global_batch: 8, lr: 3.0e-3, warmup_steps: 10, dtype: fp32, log_interval: 1,
         eval_interval: 0, eval_batches: 4}}
parallel: {{strategy: ddp, powersgd_start_step: {START if steps == STEPS else 50}}}
checkpoint: {{save_final: false, keep_last: 5}}
device: cpu
""")
    return config


# ---------------------------------------------------------------------------------------------------------------------
# worker (one rank)


def _train(config: Path, run_dir: Path, *overrides: str, resume: bool = False) -> dict:
    """Train one case; per optimizer step the bytes handed to ``dist.all_reduce`` while the synchronising backward
    ran (DDP's communication hooks issue their all-reduces there; DDP's own fp32 path does not go through Python)."""
    import torch.distributed as dist

    from anytrain.config import load_config
    from anytrain.train.trainer import Trainer

    trainer = Trainer(load_config(config, list(overrides)), run_dir=str(run_dir), resume=resume)
    sent, counting = [], [False]
    all_reduce, forward_backward = dist.all_reduce, trainer.forward_backward

    def counting_all_reduce(tensor, *args, **kwargs):
        if counting[0]:
            sent[-1] += tensor.numel() * tensor.element_size()
        return all_reduce(tensor, *args, **kwargs)

    def counted_forward_backward(*args, **kwargs):
        counting[0] = kwargs["sync"]
        if kwargs["sync"]:
            sent.append(0)
        try:
            return forward_backward(*args, **kwargs)
        finally:
            counting[0] = False

    trainer.forward_backward = counted_forward_backward
    dist.all_reduce = counting_all_reduce
    try:
        summary = trainer.train()
    finally:
        dist.all_reduce = all_reduce
        trainer.close()
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    return {
        "sent": sent,
        "val_loss": summary["final_val_loss"],
        "strategy": trainer.strategy,
        "run_dir": str(run_dir),
        "shapes": [list(p.shape) for p in params],
        "fp32_bytes": sum(4 * p.numel() for p in params),
    }


def _bucket_layout_case() -> dict:
    """PowerSGD on a toy DDP model with tiny buckets whose layout changes at DDP's rebuild (its forward uses the
    layers in the reverse of their registration order): 8 uninterrupted steps; the same with the state taken at step
    4 (``PowerSGDCheckpoint``) and given to a new DDP (new buckets, first iteration before the rebuild); and without
    the state. Returns the final parameters of each."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from anytrain.parallel.compression import CompressionHook, PowerSGDCheckpoint

    class Reversed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(24, 24) for _ in range(4))

        def forward(self, x):
            for layer in reversed(self.layers):
                x = torch.tanh(layer(x))
            return x

    def build(weights=None):
        torch.manual_seed(0)
        module = Reversed()
        if weights is not None:
            module.load_state_dict(weights)
        ddp = DDP(module, bucket_cap_mb=0.003)  # ~2 layers per bucket
        hook = CompressionHook("powersgd", None, module, rank=2, start_step=2, seed=7)
        hook.register(ddp)
        return ddp, hook

    def steps(ddp, first, last):
        for step in range(first, last):
            gen = torch.Generator().manual_seed(step * 10 + dist.get_rank())
            x = torch.randn(16, 24, generator=gen)
            ddp(x).square().mean().backward()
            with torch.no_grad():
                for p in ddp.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None

    def flat(ddp):
        return torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()]).tolist()

    ddp, _ = build()
    steps(ddp, 0, 8)
    out = {"uninterrupted": flat(ddp)}
    ddp, hook = build()
    steps(ddp, 0, 4)
    layouts = {i: layout.names for i, layout in hook._layouts.items()}
    saved = _clone(PowerSGDCheckpoint(hook, {"step": 4}).state_dict())
    weights = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    for restore in (True, False):
        ddp, hook = build(weights)
        if restore:
            PowerSGDCheckpoint(hook, {"step": 4}).load_state_dict(saved)
        else:
            hook.state.iter = 4
        steps(ddp, 4, 5)
        first = {i: layout.names for i, layout in hook._layouts.items()}
        steps(ddp, 5, 8)
        out["restored" if restore else "fresh"] = flat(ddp)
    out["layout_changed"] = first != layouts and len(layouts) > 1
    return out


def _clone(tree):
    """A nested dict with every tensor copied."""
    if isinstance(tree, dict):
        return {key: _clone(value) for key, value in tree.items()}
    return tree.clone() if hasattr(tree, "clone") else tree


def _worker(mode: str, data: Path, out: Path) -> None:
    import torch.distributed as dist

    steps = STEPS if mode == "short" else LONG_STEPS
    config = _config(out, data, steps)
    rank = f"powersgd:rank={RANK}"
    if mode == "short":
        cases = {
            "none": (),
            "bf16": ("--parallel.grad_compression", "bf16"),
            "fp16": ("--parallel.grad_compression", "fp16"),
            "powersgd": ("--parallel.grad_compression", rank),
            "zero1-powersgd": ("--parallel.grad_compression", rank, "--parallel.strategy", "zero1"),
            "fsdp-bf16": ("--parallel.grad_compression", "bf16", "--parallel.strategy", "fsdp"),
            "cut": ("--parallel.grad_compression", rank, "--train.stop_at_step", str(CUT), *SAVE_FINAL),
        }
    else:
        cases = {
            "none": (),
            "bf16": ("--parallel.grad_compression", "bf16"),
            "powersgd": ("--parallel.grad_compression", rank),
        }
    results = {name: _train(config, out / name, *overrides) for name, overrides in cases.items()}
    if mode == "short":
        results["resumed"] = _train(config, out / "cut", "--parallel.grad_compression", rank, resume=True)
        results["buckets"] = _bucket_layout_case()
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter teardown: a gloo worker thread still freeing a finished collective's tensors can need the GIL
    # during Py_Finalize and abort the process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":  # one rank (see ``_launch``)
    _worker(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))


# ---------------------------------------------------------------------------------------------------------------------
# tests


def _launch(mode: str, data: Path, out: Path) -> dict:
    from tests import forklaunch
    from tests.conftest import ROOT, cli_env

    # two ranks as torchrun starts them (its launch variables), forked from the pre-imported server
    proc = forklaunch.run([mode, str(data), str(out)], cli_env(), ROOT, nproc=2, timeout=600, main=__file__)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for name in ranks[0]:
        if name != "buckets":
            ranks[0][name]["records"] = _records(Path(ranks[0][name]["run_dir"]))
    return ranks[0] | {"rank1": ranks[1]}


def _records(run_dir: Path) -> dict[int, dict]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            out[record["step"]] = record
    return out


@pytest.fixture(scope="module")
def short(tmp_path_factory, small_data) -> dict:
    return _launch("short", small_data, tmp_path_factory.mktemp("grad_compression"))


def powersgd_bytes(shapes: list[list[int]], rank: int) -> int:
    """fp32 bytes of one PowerSGD step by the formula: a matrix n x m (dim 0 x the rest) goes as its rank-r factors,
    (n + m)·r values with r = min(n, m, rank), when that is less than half of n·m; otherwise whole."""
    values = 0
    for shape in shapes:
        n = shape[0]
        m = math.prod(shape) // n
        r = min(n, m, rank)
        values += (n + m) * r if 2 * (n + m) * r < n * m else n * m
    return 4 * values


def test_compressed_runs_train_like_the_uncompressed_one(short):
    none = [short["none"]["records"][s]["loss"] for s in range(1, STEPS + 1)]
    assert none[-1] < none[0] - 0.5  # it trains
    for name in ("bf16", "fp16", "powersgd", "zero1-powersgd", "fsdp-bf16"):
        assert abs(short[name]["val_loss"] / short["none"]["val_loss"] - 1) < 0.02, name
    # until PowerSGD starts the reduction is the plain fp32 one: the same losses as without compression
    for step in range(1, START + 2):
        assert short["powersgd"]["records"][step]["loss"] == short["none"]["records"][step]["loss"]
    assert short["powersgd"]["records"][STEPS]["loss"] != short["none"]["records"][STEPS]["loss"]


def test_bytes_per_step_are_what_the_all_reduces_carry(short):
    fp32 = short["none"]["fp32_bytes"]
    assert [short["none"]["records"][s]["grad_comm_bytes"] for s in (1, STEPS)] == [fp32, fp32]
    for name in ("bf16", "fp16"):
        assert short[name]["sent"] == [fp32 // 2] * STEPS
        assert {r["grad_comm_bytes"] for r in short[name]["records"].values()} == {fp32 / 2}
    expected = powersgd_bytes(short["powersgd"]["shapes"], RANK)
    assert expected < fp32 / 8
    for name in ("powersgd", "zero1-powersgd"):
        run = short[name]
        assert run["sent"] == [fp32] * START + [expected] * (STEPS - START), name  # step START + 1 is compressed
        logged = [run["records"][s]["grad_comm_bytes"] for s in range(1, STEPS + 1)]
        assert logged == run["sent"], name
    assert short["fsdp-bf16"]["strategy"] == "fsdp"
    assert short["fsdp-bf16"]["records"][STEPS]["grad_comm_bytes"] == fp32 // 2  # reduce-scatter input in bf16


def test_zero1_reduces_through_the_same_hook(short):
    assert short["zero1-powersgd"]["strategy"] == "zero1"
    ddp = [short["powersgd"]["records"][s]["loss"] for s in range(1, STEPS + 1)]
    zero1 = [short["zero1-powersgd"]["records"][s]["loss"] for s in range(1, STEPS + 1)]
    np.testing.assert_allclose(zero1, ddp, rtol=0, atol=1e-6)


def test_powersgd_resume_is_bitwise_the_uninterrupted_run(short):
    resumed, uninterrupted = short["resumed"]["records"], short["powersgd"]["records"]
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        for key in ("loss", "grad_norm", "grad_comm_bytes"):
            assert resumed[step][key] == uninterrupted[step][key], (step, key)


def test_powersgd_state_survives_a_change_of_bucket_layout(short):
    for buckets in (short["buckets"], short["rank1"]["buckets"]):
        assert buckets["layout_changed"]  # the resumed DDP's first buckets are not the ones the state was saved from
        assert buckets["restored"] == buckets["uninterrupted"]
        assert buckets["fresh"] != buckets["uninterrupted"]  # the state matters: without it the weights differ


@pytest.mark.slow
def test_200_steps_of_bf16_and_powersgd_end_within_2_percent(tmp_path, small_data):
    runs = _launch("long", small_data, tmp_path)
    for name in ("bf16", "powersgd"):
        assert abs(runs[name]["val_loss"] / runs["none"]["val_loss"] - 1) < 0.02, (name, runs[name]["val_loss"])
    assert runs["none"]["val_loss"] < runs["none"]["records"][1]["loss"] - 1.5


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ("--parallel.strategy", "fsdp", "--parallel.grad_compression", "powersgd:rank=4"),
            "error: parallel.grad_compression: powersgd runs with ddp or zero1 only (PyTorch has no PowerSGD for FSDP)",
        ),
        (
            ("--parallel.grad_compression", "powersgd:rank=0"),
            "error: parallel.grad_compression: expected none, bf16, fp16 or powersgd:rank=R",
        ),
        (("--parallel.grad_compression", "powersgd"), "PowerSGD needs its rank, e.g. powersgd:rank=4"),
        (("--parallel.grad_compression", "int8"), "got 'int8'"),
        (("--parallel.powersgd_start_step", "1"), "error: parallel.powersgd_start_step: must be 0"),
    ],
)
def test_bad_compression_settings_are_one_line(capsys, tmp_path, small_data, overrides, message):
    from tests.conftest import cli_in_process

    code, out, err = cli_in_process(
        capsys, "train", str(_config(tmp_path, small_data, STEPS)), *overrides, "--run-dir", str(tmp_path / "run")
    )
    assert code != 0 and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists()
