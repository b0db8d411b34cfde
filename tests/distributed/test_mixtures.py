"""Weighted mixtures of two prepared datasets (data.sources) on real gloo processes: one process vs two DDP ranks vs
a run stopped at step 2 and resumed in another world size see the same global batches, losses, realised shares and
per-source validation losses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_cli
from tests.distributed.test_data_parallel import sample_ids, train

STEPS = 4


@pytest.fixture(scope="module")
def second_source(tmp_path_factory, small_data) -> Path:
    """Four other plays, prepared with small_data's tokenizer."""
    from anytrain.data.prepare import prepare
    from tests.conftest import _corpus_files

    raw = tmp_path_factory.mktemp("raw_b")
    for file in _corpus_files(10)[6:]:
        (raw / file.name).write_text(file.read_text(encoding="utf-8", errors="replace"))
    out = tmp_path_factory.mktemp("data") / "plays_b"
    prepare([str(raw)], out, tokenizer_path=str(small_data / "tokenizer.json"), val_fraction=0.2)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_data, second_source):
    tmp = tmp_path_factory.mktemp("mix")
    config = tmp / "mix.yaml"
    config.write_text(f"""
model: {{arch: transformer, flavour: debug}}
data:
  seq_len: 32
  sources: [{{path: {small_data}, weight: 3, name: a}}, {{path: {second_source}, weight: 1, name: b}}]
train: {{steps: {STEPS}, global_batch: 8, lr: 3.0e-3, warmup_steps: 2, dtype: fp32, log_interval: 1,
         eval_interval: 2, eval_batches: 1, log_sample_ids: true}}
device: cpu
""")
    out = {"single": train(config, tmp / "single", 1), "ddp": train(config, tmp / "ddp", 2)}
    train(config, tmp / "resumed", 2, "--train.stop_at_step", "2")
    out["resumed"] = train(config, tmp / "resumed", 1, "--resume")
    return tmp, out


def by_kind(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r["kind"] == kind]


def test_global_batches_are_the_same_at_world_sizes_1_and_2_and_after_resume(runs, small_data):
    from anytrain.data.loader import SampleIndex
    from anytrain.data.shards import TokenDataset

    tmp, _ = runs
    single = sample_ids(tmp / "single", 0)
    ranks = [sample_ids(tmp / "ddp", r) for r in range(2)]
    resumed = [sample_ids(tmp / "resumed", r) for r in range(2)]  # steps 0-1 on 2 ranks, then steps 2-3 on 1
    for step in range(STEPS):
        assert ranks[0][step] + ranks[1][step] == single[step]
        assert resumed[0][step] + resumed[1].get(step, []) == single[step]
    ids = np.array([single[s] for s in range(STEPS)])  # source a's samples first, then source b's
    from_a = (ids < SampleIndex(TokenDataset(small_data).split("train"), 32).num_samples).sum(axis=1)
    assert list(from_a) == [6] * STEPS  # 3:1 of 8 sequences: exactly 6 every step


def test_losses_shares_and_per_source_validation_agree(runs):
    _, out = runs
    single, ddp, resumed = (by_kind(out[k], "train") for k in ("single", "ddp", "resumed"))
    np.testing.assert_allclose([r["loss"] for r in ddp], [r["loss"] for r in single], rtol=0, atol=2e-5)
    np.testing.assert_allclose([r["loss"] for r in resumed[-2:]], [r["loss"] for r in single[-2:]], rtol=0, atol=2e-5)
    for records in (single, ddp, resumed[-2:]):
        for r in records:
            assert r["data_share/a"] + r["data_share/b"] == pytest.approx(1.0)
    assert [r["data_share/a"] for r in ddp] == [r["data_share/a"] for r in single]
    assert [r["data_share/a"] for r in resumed[-2:]] == [r["data_share/a"] for r in single[-2:]]
    assert abs(single[-1]["data_share/a"] - 0.75) <= 1 / 16  # within one sequence per step of 3:1
    for evals in (by_kind(out["single"], "eval"), by_kind(out["ddp"], "eval")):
        for r in evals:
            assert r["val_loss"] == pytest.approx(0.75 * r["val_loss/a"] + 0.25 * r["val_loss/b"])
            assert r["val_loss/a"] != r["val_loss/b"]
    single_eval, ddp_eval = by_kind(out["single"], "eval"), by_kind(out["ddp"], "eval")
    np.testing.assert_allclose([r["val_loss/b"] for r in ddp_eval], [r["val_loss/b"] for r in single_eval], atol=2e-5)


def test_eval_reports_each_source(runs):
    tmp, _ = runs
    proc = run_cli("eval", str(tmp / "single"), "--json", "--max-new-tokens", "2", "--batches", "1", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    per_source = result["val_loss_per_source"]
    assert sorted(per_source) == ["a", "b"]
    assert result["val_loss"] == pytest.approx(0.75 * per_source["a"] + 0.25 * per_source["b"])
