"""train.fp8 (torchao's emulation) through ``anytrain train`` on real gloo ranks: 2-process DDP and FSDP2 (FP8
all-gather with precomputed scales) give the single-process FP8 run's losses within the bf16 tolerance; a
high-precision checkpoint ("bf16": fp32 on the CPU) resumes in FP8 and an FP8 FSDP one in high precision (``--resume``
with another train.fp8); the FP8 run's checkpoint holds the same entries as a bf16 run's, and its export is the same
format."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import cli_in_process, run_cli
from tests.distributed.test_data_parallel import write_config

STEPS = 6  # the data-parallel test's recipe (debug Transformer, fp32 on CPU), a checkpoint every 3 steps
FP8 = ("--train.fp8", "tensorwise", "--train.fp8_emulate", "true", "--train.fp8_filter", "aligned")
BF16_TOLERANCE = 2**-8  # relative: bf16's rounding step, the bound the FP8 runs must agree within


def _train(config: Path, run_dir: Path, nproc: int, *extra: str, resume: bool = False) -> tuple[list[dict], str]:
    args = ["train", str(config), "--run-dir", str(run_dir), "--train.steps", str(STEPS), "--checkpoint.interval", "3"]
    proc = run_cli(*args, *(["--resume"] if resume else []), *extra, nproc=nproc, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ], proc.stdout + proc.stderr


def _from_step_3(run_dir: Path, copy: Path) -> Path:
    """A copy of the run whose newest committed checkpoint is step 3's (the later one removed)."""
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "checkpoints" / f"step_{STEPS:08d}")
    return copy


def losses(records: list[dict], resumed: bool = False) -> dict[int, float]:
    """Step -> train loss; ``resumed``: only the records written after the (last) resume."""
    if resumed:
        records = records[max(i for i, r in enumerate(records) if r["kind"] == "resume") :]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


RUNS = {  # name: (processes, extra arguments)
    "fp8": (1, FP8),
    "bf16": (1, ()),
    "ddp": (2, (*FP8, "--parallel.strategy", "ddp")),
    "fsdp": (2, (*FP8, "--parallel.strategy", "fsdp")),
}


class _Runs(dict):
    """name -> (run dir, records, output), trained when a test first asks for it: a name of ``RUNS``, or the bf16 run
    resumed from step 3 in FP8 ("bf16_to_fp8"), or the FP8 FSDP run's step-3 checkpoint resumed in bf16 (train.fp8
    none) by one process ("fsdp_to_bf16")."""

    def __init__(self, tmp, config):
        super().__init__()
        self.tmp, self.config = tmp, config

    def __missing__(self, name):
        if name == "bf16_to_fp8":
            run = _from_step_3(self["bf16"][0], self.tmp / name)
            self[name] = (run, *_train(self.config, run, 1, *FP8, resume=True))
        elif name == "fsdp_to_bf16":
            run = _from_step_3(self["fsdp"][0], self.tmp / name)
            self[name] = (run, *_train(self.config, run, 1, resume=True))  # in one process
        else:
            nproc, extra = RUNS[name]
            self[name] = (self.tmp / name, *_train(self.config, self.tmp / name, nproc, *extra))
        return self[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_data) -> _Runs:
    tmp = tmp_path_factory.mktemp("fp8")
    return _Runs(tmp, write_config(tmp, small_data))


def test_fp8_trains_and_changes_the_numbers(runs):
    fp8, bf16 = losses(runs["fp8"][1]), losses(runs["bf16"][1])
    assert len(fp8) == STEPS and fp8[STEPS] < fp8[1]
    assert fp8 != bf16  # the emulated FP8 casts do change the losses ...
    np.testing.assert_allclose(list(fp8.values()), list(bf16.values()), rtol=BF16_TOLERANCE)  # ... a little
    assert "train.fp8: tensorwise FP8 matmuls in 14 of 14 candidate Linear layers" in runs["fp8"][2]
    assert "FSDP all-gathers their weights in FP8" not in runs["fp8"][2]  # FSDP only (the ddp case checks it too)


# ddp slow: DDP wraps the FP8-converted model as it wraps the plain one (the single FP8 run converts it alike); the
# FSDP case is the one with its own FP8 path (the all-gather of FP8 weights)
@pytest.mark.parametrize("name", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp"])
def test_data_parallel_fp8_matches_the_single_process_fp8_run(runs, name):
    single, other = losses(runs["fp8"][1]), losses(runs[name][1])
    assert list(other) == list(single)
    np.testing.assert_allclose(list(other.values()), list(single.values()), rtol=BF16_TOLERANCE)
    gathers = "FSDP all-gathers their weights in FP8" in runs[name][2]
    assert gathers == (name == "fsdp")


@pytest.mark.parametrize("resumed, reference", [("bf16_to_fp8", "bf16"), ("fsdp_to_bf16", "fsdp")])
def test_a_checkpoint_resumes_in_the_other_precision(runs, resumed, reference):
    """The resumed steps 4-6 (the FSDP checkpoint in one process) continue from step 3's weights: within the bf16
    tolerance of the run that wrote them (a model that did not load them would start again near the step-1 loss)."""
    after, before = losses(runs[resumed][1], resumed=True), losses(runs[reference][1])
    changed = "'none' -> 'tensorwise'" if resumed == "bf16_to_fp8" else "'tensorwise' -> 'none'"
    assert f"resume: changed train.fp8: {changed}" in runs[resumed][2]
    assert list(after) == [4, 5, 6] and after != {s: before[s] for s in after}  # computed again, in the other precision
    np.testing.assert_allclose(list(after.values()), [before[s] for s in after], rtol=BF16_TOLERANCE)


def test_fp8_checkpoints_hold_plain_tensors_under_the_same_names(runs):
    """FSDP's FP8 all-gather wraps each weight in a torchao tensor subclass; the checkpoint holds the plain tensor:
    the same names, shapes and dtypes as the bf16 run's, read by DCP without torchao's classes (the bf16 resume above
    loaded it in a process that never imported torchao)."""
    from torch.distributed.checkpoint import FileSystemReader

    def entries(run: str) -> dict:
        metadata = FileSystemReader(str(runs[run][0] / "checkpoints" / "step_00000003")).read_metadata()
        items = metadata.state_dict_metadata.items()
        return {k: _shape(v) for k, v in items if k.startswith(("train.model.", "train.optim."))}

    fsdp, bf16 = entries("fsdp"), entries("bf16")
    assert fsdp == bf16 and "train.model.layers.0.attention.wq.weight" in fsdp


def _shape(entry) -> tuple | str:
    """A DCP metadata entry as (shape, dtype), or "bytes" for a pickled one."""
    return (tuple(entry.size), entry.properties.dtype) if hasattr(entry, "size") else "bytes"


def test_export_of_an_fp8_run_is_unchanged(runs, capsys, tmp_path, monkeypatch):
    """``anytrain export`` of the FP8 FSDP run: the bf16 run's names, shapes, dtypes and config.json, written by a
    process where torchao cannot be imported (export reads the plain model)."""
    from safetensors.torch import load_file

    monkeypatch.setitem(sys.modules, "torchao", None)  # what Python does for a package that cannot be imported
    exported = {}
    for name in ("fsdp", "bf16"):
        code, _, err = cli_in_process(capsys, "export", str(runs[name][0]), "--out", str(tmp_path / name))
        assert code == 0, err
        exported[name] = load_file(str(tmp_path / name / "model.safetensors"))
    fsdp, bf16 = exported["fsdp"], exported["bf16"]
    assert {k: (v.shape, v.dtype) for k, v in fsdp.items()} == {k: (v.shape, v.dtype) for k, v in bf16.items()}
    assert (tmp_path / "fsdp" / "config.json").read_text() == (tmp_path / "bf16" / "config.json").read_text()


LAYOUTS = {
    "zero1": (2, ("--parallel.strategy", "zero1")),
    "fsdp_rowwise": (2, ("--parallel.strategy", "fsdp", "--train.fp8", "rowwise")),
    "tp": (2, ("--parallel.tp", "2")),
    "pp": (2, ("--parallel.pp", "2")),
    "hsdp": (4, ("--parallel.strategy", "fsdp", "--parallel.dp_replicate", "2")),
    "fsdp_tp": (4, ("--parallel.strategy", "fsdp", "--parallel.tp", "2")),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_other_layouts_match_the_single_process_fp8_run(runs, tmp_path, small_data, name):
    """ZeRO-1, FSDP with a row-wise recipe (no FP8 all-gather), TP (DTensor's styles on FP8 layers), PP, HSDP and
    FSDP + TP: the first losses within bf16's rounding of the one-process run of the same recipe."""
    nproc, extra = LAYOUTS[name]
    config = write_config(tmp_path, small_data)
    records, _ = _train(config, tmp_path / name, nproc, *FP8, *extra)
    if "rowwise" in extra:
        single = losses(_train(config, tmp_path / "single", 1, *FP8, *extra[2:])[0])
    else:
        single = losses(runs["fp8"][1])
    other = losses(records)
    assert list(other) == list(single)
    np.testing.assert_allclose(list(other.values()), list(single.values()), rtol=BF16_TOLERANCE)
