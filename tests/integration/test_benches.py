"""The benches' CPU smoke modes: their anytrain rows must run the product's own Trainer.train_step (a bench that
silently fell back to other code, or broke when the trainer changed, would report numbers of something else)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import ROOT, cli_env


def _bench(tmp_path, script: str, *flags: str) -> list[dict]:
    return _bench_run(tmp_path, script, *flags)[0]


def _bench_run(tmp_path, script: str, *flags: str) -> tuple[list[dict], str]:
    """The bench's result rows and its standard output (``python -m bench.SCRIPT FLAGS``, forked from the pre-imported
    server: the same process without the interpreter and torch start-up)."""
    from tests import forklaunch

    proc = forklaunch.run([*flags, "--out", str(tmp_path)], cli_env(), ROOT, timeout=600, main=f"bench.{script}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob(f"{script}_*.json")
    return json.loads(path.read_text())["rows"], proc.stdout


# the mamba2 bench smoke below drives Trainer.train_step the same way (bench.common's rows); Mamba-1's trainer path is
# tests/distributed/test_mamba_parallel.py's
@pytest.mark.slow
def test_mamba_train_bench_drives_the_trainer(tmp_path):
    rows = [r for r in _bench(tmp_path, "mamba_train", "--quick") if not r.get("name", "").startswith("hf")]
    assert rows and all(r.get("driver") == "Trainer.train_step" and r.get("tokens_per_s", 0) > 0 for r in rows), rows


def test_mamba2_train_bench_smoke_rows_drive_the_trainer(tmp_path):
    """The Mamba-2 and hybrid recipe rows train through Trainer.train_step at the debug flavours, with the recipe's
    activation checkpointing; ``--profile`` adds one profiled step to the row it names."""
    rows = ["mamba2-1.3b", "hybrid-1.2b"]
    flags = ["--smoke", "--in-process", "--rows", *rows, "--profile", "mamba2-1.3b"]
    got, stdout = _bench_run(tmp_path, "mamba2_train", *flags)
    assert [r["row"] for r in got] == rows
    for r in got:
        assert "error" not in r and r["driver"] == "Trainer.train_step" and r["tokens_per_s"] > 0, r
        assert (r["flavour"], r["activation_checkpointing"], r["recipe"]) == (
            "debug",
            "full",
            f"configs/{r['row']}.yaml",
        )
    assert [r["arch"] for r in got] == ["mamba2", "hybrid"]
    # --profile: one more step of the named row under torch.profiler (operators on CPU), the others untouched
    profile = got[0]["kernel_profile"]
    assert profile["kernel_ms"] > 0 and profile["top"] and "kernel_profile" not in got[1]
    assert "profile of one step of mamba2-1.3b" in stdout


def test_transformer_bench_smoke_rows_run(tmp_path):
    rows = _bench(tmp_path, "transformer", "--smoke", "--in-process")  # rows in one process: no start-up per row
    assert rows and all(r.get("error") is None and r.get("tokens_per_s", 0) > 0 for r in rows), rows


@pytest.mark.slow  # two child processes; the Trainer path of the rows is covered by the transformer bench smoke
def test_alibi_bench_trains_ours_and_transformers_mpt_of_the_same_shape(tmp_path):
    rows = _bench(tmp_path, "alibi", "--smoke", "--rows", "train-alibi-flex", "train-alibi-hfmpt")
    by = {r["row"]: r for r in rows}
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in rows), rows
    # the same model: equal parameter counts, the HF row built from the config anytrain's export writes
    assert by["train-alibi-hfmpt"]["params"] == by["train-alibi-flex"]["params"]
    assert by["train-alibi-hfmpt"]["driver"] == "MptForCausalLM + torch.compile"


def test_mamba_train_hf_row_halves_its_micro_batch_when_it_runs_out_of_memory(monkeypatch):
    # HF's slow path needs ~80 GiB at mamba-130m x micro-batch 8: on an 80 GB card the row must halve its micro-batch
    # (same global batch) instead of losing the side-by-side baseline. A stand-in for HF's step runs out of memory
    # above micro-batch 2; the retry logic and the timing are the bench's own.
    import torch

    from bench import mamba_train

    built = []

    def fake_hf_step_fn(case, device, batches):
        built.append(case.micro)

        def step(i):
            if case.micro > 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.54 GiB")

        return step, {"hf_params": 1}, object()

    monkeypatch.setattr(mamba_train, "hf_step_fn", fake_hf_step_fn)
    case = mamba_train.Case("hf-x", "debug", 64, 8, 8, "hf", "stand-in", warmup=1, steps=2)
    row = mamba_train.run_case(case, torch.device("cpu"))
    assert built == [8, 4, 2] and row["micro_out_of_memory"] == [8, 4] and row["micro"] == 2, row
    assert "error" not in row and row["tokens_per_s"] > 0 and row["driver"] == "hf", row
    assert case.micro == 8  # the caller's case is not changed

    # a global batch that the halved micro-batch does not divide (9 / 4): no retry, an error row
    row = mamba_train.run_case(mamba_train.Case("hf-y", "debug", 64, 9, 9, "hf", "stand-in"), torch.device("cpu"))
    assert row["error"].startswith("out of memory") and built[3:] == [9], row


@pytest.mark.slow  # the native scorer and the bridge agree item for item in test_eval_tasks.py
def test_eval_throughput_smoke_trains_exports_and_scores_three_ways(tmp_path):
    # python -m bench.eval_throughput --smoke: tiny Llama and Mamba runs trained and exported through the CLI, loaded in
    # transformers; the native scorer, the lm-eval bridge and (where accelerate is installed: the eval and dev extras)
    # lm-eval's own HFLM score the same task from the corpus. In fp32 on the CPU they must see the same sequences and
    # agree exactly, acc_norm included (anytrain normalises as lm-eval: by the characters of the choice). HFLM scores
    # only the Mamba task's first 8 items (--stack-items, as the GPU default's hflm@mamba=64), compared with the
    # native scores of those items.
    import importlib.util

    import pytest

    pytest.importorskip("lm_eval")
    pytest.importorskip("transformers")
    stacks = ["native", "bridge"] + (["hflm"] if importlib.util.find_spec("accelerate") else [])
    rows = _bench(tmp_path, "eval_throughput", "--smoke", "--stacks", *stacks, "--stack-items", "hflm@mamba=8")
    classes = [(r["name"], r["generate"]["class"]) for r in rows]
    assert classes == [("tiny", "LlamaForCausalLM"), ("tiny-mamba", "MambaForCausalLM")], rows
    assert not (tmp_path / "eval_throughput.partial.json").exists()  # replaced by the complete file at the end
    for row in rows:
        assert "error" not in row and row["stages"]["train_s"] > 0 and row["stages"]["export_s"] > 0, row
        assert (tmp_path / "eval_throughput_logs" / f"{row['name']}_eval_row.json").is_file()  # written per stack
        runs = row["stacks"]
        assert sorted(runs) == sorted(stacks) and all(s.get("examples_per_s", 0) > 0 for s in runs.values()), runs
        native, bridge = runs["native"], runs["bridge"]
        assert native["n"] == bridge["n"] == 12 and native["requests"] == bridge["requests"] == 48, runs
        assert (bridge["acc"], bridge["acc_norm"]) == (native["acc"], native["acc_norm"]), runs
        if "hflm" in runs:
            hflm = runs["hflm"]
            assert hflm["eos_first"], runs  # add_bos_token: <|endoftext|> first, as anytrain
            if row["name"] == "tiny-mamba":
                assert (hflm["n"], hflm["requests"], hflm["item_limit"]) == (8, 32, 8), runs
                assert (hflm["acc"], hflm["acc_norm"]) == tuple(native["first"]["8"].values()), runs
            else:
                assert hflm["n"] == 12 and "first" not in native, runs
                assert (hflm["acc"], hflm["acc_norm"]) == (native["acc"], native["acc_norm"]), runs
        generated = row["generate"]
        assert generated["new_tokens"] == 8 and generated["tokens_per_s"] > 0, generated
        assert generated["common_prefix_chars"] == len(generated["native_text"]), generated  # same greedy text


def test_spread_runs_each_job_on_one_gpu_under_its_limit_and_packs_one_file(tmp_path):
    """bench/device/spread.sh with two GPUs named by count (no GPU needed: jobs only read the variable)."""
    import tarfile

    jobs = tmp_path / "jobs.txt"
    jobs.write_text(
        '# a comment\nT=5 echo "gpu $CUDA_VISIBLE_DEVICES" > $JOB_OUT/a.txt\n\nT=1 sleep 5\n'
        'echo "gpu $CUDA_VISIBLE_DEVICES" > $JOB_OUT/c.txt\n'
    )
    proc = subprocess.run(
        ["bash", "bench/device/spread.sh", str(jobs), "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**cli_env(), "OUT": str(tmp_path / "out")},
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    with tarfile.open(tmp_path / "out" / "spread.tgz") as tar:
        tar.extractall(tmp_path / "x", filter="data")
    summary = (tmp_path / "x" / "summary.txt").read_text()
    assert "job 1 on GPU 1: rc 124" in summary  # its own limit (T=1) stopped it
    assert (tmp_path / "x" / "0" / "a.txt").read_text() == "gpu 0\n"
    assert (tmp_path / "x" / "2" / "c.txt").read_text() == "gpu 1\n"  # the least-loaded GPU (1 s queued vs 5 s)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["spread.tgz"]


# the per-mesh groups (build_optimizer(by_mesh=True)) are what the trainer builds at tp > 1 (test_model_parallel,
# test_transformer_options_tp); split_by_mesh is unit-tested in test_optim.py
@pytest.mark.slow
def test_tp_optimizer_bench_times_per_parameter_and_per_mesh_updates_on_two_ranks(tmp_path):
    from tests import forklaunch

    # ``torchrun --nproc_per_node 2 -m bench.tp_optimizer``: two ranks with its launch variables, forked from the
    # pre-imported server
    args = ["--steps", "2", "--warmup", "1", "--out", str(tmp_path)]
    proc = forklaunch.run(args, cli_env(), ROOT, nproc=2, timeout=300, main="bench.tp_optimizer")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("tp_optimizer_tp2_*.json")
    rows = {r["row"]: r for r in json.loads(path.read_text())["rows"]}
    per_param, ours = rows["per-parameter AdamW (foreach=False)"], rows["anytrain (groups per mesh, foreach)"]
    assert per_param["params"] == ours["params"] == 201  # the 1.1B's parameter structure, tensor-parallel
    # decay / no-decay; the decay matrices split by mesh: the TP DTensors and the plain (replicated) LM-head weight
    assert per_param["param_groups"] == 2 and ours["param_groups"] == 3
    assert per_param["ms_per_step"] > 0 and ours["ms_per_step"] > 0
