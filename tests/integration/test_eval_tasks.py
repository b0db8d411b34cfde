"""``anytrain eval RUN --tasks`` and ``--lm-eval`` on a tiny trained run: results files, the printed table, and the
lm-evaluation-harness bridge asking for exactly the native scorer's prompts and agreeing on accuracy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from anytrain.config import load_config
from anytrain.evals.lm_eval_bridge import write_local_task
from tests.conftest import cli_in_process as cli

ITEMS = [
    {"context": f"ROMEO. Scene {i}:", "choices": ["love", "hate", "death and night"][: 2 + i % 2], "label": i % 2}
    for i in range(10)
]


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_data) -> Path:
    from anytrain.train.trainer import run_training

    run_dir = tmp_path_factory.mktemp("evaltasks") / "run"
    cfg = load_config(
        "configs/tiny.yaml",
        [
            "--model.flavour",
            "debug",
            "--model.args.n_layers",
            "1",
            "--data.path",
            str(small_data),
            "--data.seq_len",
            "32",
            "--train.global_batch",
            "4",
            "--train.steps",
            "2",
            "--train.eval_batches",
            "1",
            "--train.dtype",
            "fp32",
        ],
    )
    run_training(cfg, run_dir=str(run_dir))
    return run_dir


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tasks")
    (folder / "toy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ITEMS))
    write_local_task("toy_lm", folder / "toy.jsonl", folder)
    (folder / "lines.txt").write_text("But, soft! what light through yonder window breaks?\n" * 8)
    return folder


def test_eval_tasks_writes_results_and_a_table(run, task_dir, capsys):
    code, out, err = cli(
        capsys,
        "eval",
        str(run),
        "--tasks",
        f"val,toy,{task_dir / 'lines.txt'}",
        "--task-dir",
        str(task_dir),
        "--num-fewshot",
        "2",
        "--limit",
        "4",
    )
    assert code == 0, err
    toy = json.loads((run / "evals" / "toy.json").read_text())
    assert (toy["format"], toy["n"], toy["num_fewshot"], toy["step"]) == ("mc", 4, 2, 2)
    assert 0 <= toy["acc"] <= 1 and 0 <= toy["acc_norm"] <= 1
    val = json.loads((run / "evals" / "val.json").read_text())
    assert val["tokens"] == 4 * 32 and 1 < val["ppl"] < 600 and val["bits_per_byte"] > 0
    lines = json.loads((run / "evals" / "lines.json").read_text())
    assert lines["tokens"] == 4 * 32 and 0 < lines["bytes"] < len((task_dir / "lines.txt").read_text())
    for row in ("toy                  acc ", "val                  bits_per_byte", "lines                ppl"):
        assert row in out
    code, out, err = cli(capsys, "eval", str(run), "--tasks", "nothere", "--task-dir", str(task_dir))
    assert code == 2 and err.startswith("error: --tasks nothere: no file nothere") and len(err.splitlines()) == 1


def test_lm_eval_bridge_asks_for_the_native_prompts_and_agrees(run, task_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pytest.importorskip("lm_eval")
    from anytrain.evals.lm_eval_bridge import model_class, run_lm_eval
    from anytrain.evals.tasks import build_requests, load_task, score_task, scorer_for_run

    scorer, _, _ = scorer_for_run(run)
    asked: list[tuple[str, str]] = []
    original = scorer.loglikelihood
    scorer.loglikelihood = lambda pairs: (asked.extend(pairs := list(pairs)), original(pairs))[1]
    bridged = run_lm_eval(scorer, ["toy_lm"], task_dir, builtin_tasks=False)["toy_lm"]
    task = load_task(task_dir / "toy.jsonl")
    assert sorted(asked) == sorted(build_requests(task))  # lm-eval's prompts are the native ones
    native = score_task(scorer, task)
    assert (bridged["acc"], bridged["acc_norm"], bridged["n"]) == (native["acc"], native["acc_norm"], native["n"])
    from lm_eval.api.registry import get_model

    assert get_model("anytrain") is model_class()


# acc_norm: lm-eval divides each choice's log-likelihood by len(choice), the choice's characters without the " "
# delimiter; that picks choice 1, the label, in every item. The raw sum picks choice 0 in every item, and each other
# plausible normalisation (UTF-8 bytes of " " + choice, as anytrain had; characters of " " + choice; bytes of the
# choice) picks choice 0 in at least one item: a scorer using any of them fails the test.
NORM_ITEMS = [
    ({"context": "Q1:", "choices": ["a", "bbbb"], "label": 1}, {" a": -1.0, " bbbb": -3.8}),  # ASCII: the space
    ({"context": "Q2:", "choices": ["ééé", "abcd"], "label": 1}, {" ééé": -3.3, " abcd": -4.2}),  # 2-byte chars
    ({"context": "Q3:", "choices": ["日本", "nihon"], "label": 1}, {" 日本": -2.4, " nihon": -5.5}),  # 3-byte chars
]


class FixedScorer:
    """A scorer stand-in: a fixed log-likelihood per continuation (what lm-eval and the native scorer then rank)."""

    eos_id, max_len = 0, 64

    def __init__(self, lls: dict[str, float]) -> None:
        self.lls, self.asked = lls, []

    def loglikelihood(self, pairs):
        pairs = list(pairs)
        self.asked.extend(pairs)
        return [(self.lls[continuation], False) for _, continuation in pairs]


def test_acc_norm_divides_by_the_characters_of_the_choice_as_lm_eval(tmp_path, monkeypatch):
    from anytrain.evals.tasks import load_task, norm_scores, score_task

    conventions = {
        "bytes of ' ' + choice": lambda c: len((" " + c).encode()),
        "chars of ' ' + choice": lambda c: len(" " + c),
        "bytes of choice": lambda c: len(c.encode()),
    }
    wrong = dict.fromkeys(conventions, 0)
    for record, lls in NORM_ITEMS:
        choices, label = record["choices"], record["label"]
        scores = [lls[" " + c] for c in choices]
        assert max((0, 1), key=scores.__getitem__) != label, record
        assert list(norm_scores(scores, choices)) == [ll / len(c) for ll, c in zip(scores, choices, strict=True)]
        for name, length in conventions.items():
            other = [ll / length(c) for ll, c in zip(scores, choices, strict=True)]
            wrong[name] += max((0, 1), key=other.__getitem__) != label
    assert all(wrong.values()), wrong
    (tmp_path / "norm.jsonl").write_text("".join(json.dumps(r) + "\n" for r, _ in NORM_ITEMS), encoding="utf-8")
    write_local_task("norm_lm", tmp_path / "norm.jsonl", tmp_path)
    scorer = FixedScorer({k: v for _, lls in NORM_ITEMS for k, v in lls.items()})
    native = score_task(scorer, load_task(tmp_path / "norm.jsonl"))
    assert native == {"acc": 0.0, "acc_norm": 1.0, "n": 3}

    # lm-eval's own process_results over the same log-likelihoods (the bridge): the same acc_norm, item for item
    # (every item right, so the mean cannot hide a disagreement)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pytest.importorskip("lm_eval")
    from anytrain.evals.lm_eval_bridge import run_lm_eval

    bridged = run_lm_eval(scorer, ["norm_lm"], tmp_path, builtin_tasks=False)["norm_lm"]
    assert (bridged["acc"], bridged["acc_norm"], bridged["n"]) == (0.0, 1.0, 3)
