"""bench/torchtitan_stack.py without a GPU: the torchtitan arguments, the data it feeds, and (where torchtitan is
installed; it is not a dependency) the flavours against anytrain's and the JobConfig its ConfigManager parses."""

import pytest
import torch

from bench import torchtitan_stack
from bench.common import RandomBatches

CASE = {"flavour": "llama-1b", "seq": 2048, "micro": 8, "global_batch": 32, "precision": "bf16", "options": {}}


def _fields(argv: list[str]) -> dict:
    out, i = {}, 0
    while i < len(argv):
        key = argv[i].removeprefix("--")
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[key], i = argv[i + 1], i + 2
        else:
            out[key], i = True, i + 1
    return out


def test_arguments_carry_the_case_shape_batch_and_precision():
    fields = _fields(torchtitan_stack.titan_argv(CASE, 2, 10, True, "/tmp/x"))
    assert (fields["model.name"], fields["model.flavor"]) == ("anytrain_llama3", "1B")
    assert (fields["training.seq_len"], fields["training.local_batch_size"]) == ("2048", "8")
    assert (fields["training.global_batch_size"], fields["training.steps"]) == ("32", "12")
    assert fields["compile.enable"] is True and fields["metrics.log_freq"] == "1"
    assert "model.converters" not in fields
    fp8 = {**CASE, "precision": "fp8-rowwise", "options": {"activation_checkpoint.mode": "none"}}
    fields = _fields(torchtitan_stack.titan_argv(fp8, 1, 10, False, "/tmp/x"))
    assert fields["model.converters"] == "quantize.linear.float8"
    assert fields["quantize.linear.float8.recipe_name"] == "rowwise"
    assert fields["quantize.linear.float8.filter_fqns"] == "output,auto_filter_small_kn"
    assert fields["activation_checkpoint.mode"] == "none" and "compile.enable" not in fields
    with pytest.raises(ValueError, match="precision"):
        torchtitan_stack.titan_argv({**CASE, "precision": "fp16"}, 1, 1, True, "/tmp/x")


def test_loader_yields_the_anytrain_rows_batches_in_micro_batches():
    loader = iter(torchtitan_stack.RandomTokenLoader(vocab=512, global_batch=8, micro=2, seq=16))
    bank = RandomBatches(512, 8, 16)
    for step in range(6):  # past the bank's 4 batches: it cycles as the anytrain rows' source does
        inputs, labels, _ = bank.rank_batch(step)
        for k in range(4):
            batch, target = next(loader)
            assert torch.equal(batch["input"], inputs[2 * k : 2 * k + 2])
            assert torch.equal(target, labels[2 * k : 2 * k + 2])


def test_flavours_match_anytrains_and_the_job_config_parses():
    pytest.importorskip("torchtitan")
    from torchtitan.config import ConfigManager

    models = torchtitan_stack.titan_model_args()
    for ours, theirs in torchtitan_stack.TORCHTITAN_FLAVOURS.items():
        counts = torchtitan_stack.check_shapes(ours, models[theirs])
        head = 0 if not counts["anytrain_tied_embeddings"] else models[theirs].vocab_size * models[theirs].dim
        assert counts["params"] == counts["anytrain_params"] + head  # its llama3 has no tied head
    fp8 = {**CASE, "flavour": "llama-3b", "precision": "fp8-rowwise", "options": {"activation_checkpoint.mode": "none"}}
    config = ConfigManager().parse_args(torchtitan_stack.titan_argv(fp8, 1, 10, True, "/tmp/x"))
    assert (config.model.flavor, config.training.local_batch_size, config.training.steps) == ("3B", 8, 11)
    assert config.quantize.linear.float8.filter_fqns == ["output", "auto_filter_small_kn"]
    assert config.activation_checkpoint.mode == "none" and config.compile.enable


def test_side_by_side_groups_share_seq_and_batch_and_cover_every_precision():
    from bench import transformer as transformer_bench

    cases = transformer_bench.side_by_side_cases()
    titan = [c for c in cases if c.flavour in ("llama-1b", "llama-3b")]
    assert {c.flavour for c in titan} == {"llama-1b", "llama-3b"} <= set(torchtitan_stack.TORCHTITAN_FLAVOURS)
    precisions = ("bf16", "fp8-tensorwise", "fp8-rowwise")
    wanted = {(stack, p) for stack in ("anytrain", "torchtitan") for p in precisions}
    wanted |= {("hf-compile", p) for p in precisions[1:]}
    for group in {c.group for c in titan}:
        rows = [c for c in titan if c.group == group]
        assert len({(c.flavour, c.seq, c.global_batch) for c in rows}) == 1  # same tokens per step
        assert all(c.global_batch % c.micro == 0 for c in rows)
        assert wanted == {(c.stack, c.precision) for c in rows}
    # the 1.1B recipe's shape: anytrain FP8 beside its bf16 recipe row (default_cases) and HF + torchao, no torchtitan
    small = [c for c in cases if c.flavour == "1.1b"]
    assert {(c.stack, c.precision) for c in small} == {
        (s, p) for s in ("anytrain", "hf-compile") for p in precisions[1:]
    }
    assert {(c.seq, c.global_batch) for c in small} == {(2048, 32)}
    recipe = [c for c in transformer_bench.default_cases() if c.label == "anytrain recipe (configs/1.1b.yaml)"]
    assert [(c.group, c.micro) for c in recipe] == [(c.group, c.micro) for c in small if c.stack == "anytrain"][:1]


def test_ratios_compare_rows_of_the_same_precision():
    from bench import transformer as transformer_bench

    def row(stack: str, precision: str, rate: float) -> dict:
        group = dict(group="llama-1b-2048", flavour="llama-1b", seq=2048, flops_per_token=1.0)
        return {**group, "stack": stack, "precision": precision, "tokens_per_s": rate}

    rows = [row("anytrain", "bf16", 120.0), row("torchtitan", "bf16", 100.0), row("torchtitan", "fp8-rowwise", 150.0)]
    rows += [row("anytrain", "fp8-rowwise", 165.0), row("hf-compile", "fp8-rowwise", 110.0)]
    transformer_bench.finish_rows(rows, peak=None)
    assert [r["ratio_vs_torchtitan"] for r in rows] == pytest.approx([1.2, 1.0, 1.0, 1.1, 110 / 150])
    assert rows[0]["ratio_vs_best_hf"] is None and rows[3]["ratio_vs_best_hf"] == pytest.approx(1.5)


def test_recorder_profiles_the_step_between_two_logs(tmp_path):
    """torchtitan logs step s (1-based) at its end: with a profiler for 0-based step 2, the profile covers what runs
    between the logs of steps 2 and 3, and nothing before or after."""
    from anytrain.train.profiling import StepProfiler

    recorder = torchtitan_stack.StepRecorder()
    recorder.profiler = StepProfiler(2, 1, tmp_path, 0, torch.device("cpu"))
    a = torch.randn(64, 64)
    for step in range(1, 5):
        if step == 3:
            torch.linalg.qr(a)  # the profiled step's work
        else:
            torch.linalg.svd(a)
        recorder.log({"loss": 1.0}, step)
    summary = recorder.profiler.summary
    assert summary is not None and summary["steps"] == [2, 2] and (tmp_path / "rank0.json").exists()
    ops = " ".join(r["op"] for r in summary["host_top"])
    assert "qr" in ops and "svd" not in ops
    assert [s["step"] for s in recorder.steps] == [1, 2, 3, 4]
