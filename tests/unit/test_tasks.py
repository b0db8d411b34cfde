"""Downstream scoring (evals/tasks.py): task-file loaders, k-shot prompts, log-likelihoods against a direct
computation, a model with a known answer, perplexity / bits per byte."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from anytrain.data.prepare import EOS, train_tokenizer
from anytrain.errors import DataError
from anytrain.evals.tasks import Scorer, build_requests, load_task, score_task, text_metrics

TEXTS = ["the cat sat on the mat", "yes no maybe so", "Question: is it so?\nAnswer: yes"] * 20


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(iter(TEXTS), vocab_size=300)


class BiasedLM(torch.nn.Module):
    """Random logits from the current token, plus ``bias`` on ``favoured`` token ids (a model that knows)."""

    def __init__(self, vocab: int, favoured: list[int] = (), bias: float = 0.0) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0)))
        self.extra = torch.zeros(vocab)
        self.extra[list(favoured)] = bias

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids] + self.extra  # (B, T, V)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def mc_task(tmp_path, n=4):
    records = [{"context": f"Q{i}:", "choices": [f"a{i}", f"b{i}"], "label": i % 2} for i in range(n)]
    return load_task(write_jsonl(tmp_path / "toy.jsonl", records))


def test_k_shot_prompts_are_built_exactly(tmp_path):
    task = mc_task(tmp_path)
    assert task.format == "mc" and task.kind == "multiple_choice"
    assert build_requests(task, 0) == [
        ("Q0:", " a0"),
        ("Q0:", " b0"),
        ("Q1:", " a1"),
        ("Q1:", " b1"),
        ("Q2:", " a2"),
        ("Q2:", " b2"),
        ("Q3:", " a3"),
        ("Q3:", " b3"),
    ]
    pairs = build_requests(task, 2, seed=7)
    # seed 7 draws items (1, 3) for item 0, (0, 3) for 1, (3, 1) for 2, (2, 0) for 3; never the item itself
    assert pairs[0] == ("Q1: b1\n\nQ3: b3\n\nQ0:", " a0") and pairs[1] == ("Q1: b1\n\nQ3: b3\n\nQ0:", " b0")
    assert pairs[2] == ("Q0: a0\n\nQ3: b3\n\nQ1:", " a1")
    assert pairs[4] == ("Q3: b3\n\nQ1: b1\n\nQ2:", " a2")
    assert pairs[6] == ("Q2: a2\n\nQ0: a0\n\nQ3:", " a3")
    assert build_requests(task, 2, seed=7, count=1) == pairs[:2]  # --limit does not change the shots
    with pytest.raises(DataError, match="needs at least 5 items"):
        build_requests(task, 4)


def test_loglikelihood_equals_a_direct_computation_in_any_batch(tokenizer):
    model = BiasedLM(tokenizer.get_vocab_size())
    eos = tokenizer.token_to_id(EOS)
    pairs = [("the cat sat", " on the mat"), ("yes ", "no"), ("", "maybe so"), ("Question: is it so?\nAnswer:", " yes")]
    results = Scorer(model, tokenizer, eos, max_len=64, batch_size=3).loglikelihood(pairs)
    one_by_one = Scorer(model, tokenizer, eos, max_len=64, batch_size=1).loglikelihood(pairs)
    assert [ll for ll, _ in one_by_one] == pytest.approx([ll for ll, _ in results], abs=1e-5)
    assert [g for _, g in one_by_one] == [g for _, g in results]
    for (context, continuation), (ll, greedy) in zip(pairs, results, strict=True):
        if context.endswith(" "):  # the context's trailing space moves to the continuation (lm-eval)
            context, continuation = context[:-1], " " + continuation
        head = tokenizer.encode(context).ids if context else []
        whole = tokenizer.encode(context + continuation).ids
        ids = torch.tensor([[eos] + whole])
        logprobs = F.log_softmax(model(ids[:, :-1]), -1)[0]
        targets = ids[0, 1 + len(head) :]
        span = logprobs[len(head) :]
        assert ll == pytest.approx(span.gather(-1, targets[:, None]).sum().item(), abs=1e-4)
        assert greedy == bool((span.argmax(-1) == targets).all())


def test_a_model_that_knows_the_answer_scores_full_marks(tmp_path, tokenizer):
    records = [{"context": "Question: is it so?\nAnswer:", "choices": ["no", "yes", "maybe"], "label": 1}] * 3
    task = load_task(write_jsonl(tmp_path / "known.jsonl", records))
    knows = BiasedLM(tokenizer.get_vocab_size(), tokenizer.encode(" yes").ids, bias=30.0)
    eos = tokenizer.token_to_id(EOS)
    result = score_task(Scorer(knows, tokenizer, eos, max_len=64), task, k=1)
    assert result == {"acc": 1.0, "acc_norm": 1.0, "n": 3}
    wrong = BiasedLM(tokenizer.get_vocab_size(), tokenizer.encode(" no").ids, bias=30.0)
    assert score_task(Scorer(wrong, tokenizer, eos, max_len=64), task, limit=2) == {"acc": 0.0, "acc_norm": 0.0, "n": 2}


def test_perplexity_and_bits_per_byte_of_a_uniform_model(tokenizer):
    vocab = tokenizer.get_vocab_size()
    uniform = lambda ids: torch.zeros(*ids.shape, vocab)  # noqa: E731
    ids = tokenizer.encode("the cat sat on the mat " * 10).ids
    metrics = text_metrics(Scorer(uniform, tokenizer, 0, max_len=7, batch_size=2), ids, num_bytes=230)
    assert metrics["tokens"] == len(ids)  # every token once, across windows
    assert metrics["ppl"] == pytest.approx(vocab)
    assert metrics["bits_per_byte"] == pytest.approx(len(ids) * math.log2(vocab) / 230)


@pytest.mark.parametrize(
    "record, context, continuations, label",
    [
        (
            {
                "ctx_a": "A man is sitting.",
                "ctx_b": "he [title] waves",
                "ctx": "",
                "activity_label": "Waving",
                "endings": ["and  smiles.", "and [x]leaves."],
                "label": "1",
            },
            "Waving: A man is sitting. He. waves",
            [" and smiles.", " and leaves."],
            1,
        ),
        (
            {
                "question": {
                    "stem": "Which is hot?",
                    "choices": [{"text": "ice", "label": "A"}, {"text": "fire", "label": "B"}],
                },
                "answerKey": "B",
            },
            "Question: Which is hot?\nAnswer:",
            [" ice", " fire"],
            1,
        ),
        (
            {"question": "Which is hot?", "choices": {"text": ["ice", "fire"], "label": ["1", "2"]}, "answerKey": "1"},
            "Question: Which is hot?\nAnswer:",
            [" ice", " fire"],
            0,
        ),
        (
            {"goal": "Open a jar", "sol1": "twist", "sol2": "bite", "label": 0},
            "Question: Open a jar\nAnswer:",
            [" twist", " bite"],
            0,
        ),
        (
            {"question": "is ice cold", "title": "Ice", "answer": True, "passage": "Ice is frozen water."},
            "Ice is frozen water.\nQuestion: is ice cold?\nAnswer:",
            [" no", " yes"],
            1,
        ),
        ({"text": "to be or not to be"}, "to be or not to", [" be"], 0),
    ],
)
def test_loaders_make_lm_eval_prompts(tmp_path, record, context, continuations, label):
    item = load_task(write_jsonl(tmp_path / "t.jsonl", [record])).items[0]
    assert (item.contexts, item.continuations, item.label) == ([context], continuations, label)


def test_winogrande_scores_the_same_ending_after_each_option(tmp_path):
    record = {
        "sentence": "The ball broke the window because _ was hard.",
        "option1": "the ball",
        "option2": "the window",
        "answer": "1",
    }
    task = load_task(write_jsonl(tmp_path / "w.jsonl", [record]))
    assert task.format == "winogrande"
    assert build_requests(task) == [
        ("The ball broke the window because the ball", " was hard."),
        ("The ball broke the window because the window", " was hard."),
    ]


def test_piqa_labels_from_the_lst_beside_the_file(tmp_path):
    write_jsonl(tmp_path / "valid.jsonl", [{"goal": "g", "sol1": "a", "sol2": "b"}] * 2)
    (tmp_path / "valid-labels.lst").write_text("1\n0\n")
    assert [i.label for i in load_task(tmp_path / "valid.jsonl").items] == [1, 0]


def test_unknown_records_are_one_line(tmp_path):
    with pytest.raises(DataError, match=r"first record has keys \['foo'\]; expected those of one of mc"):
        load_task(write_jsonl(tmp_path / "x.jsonl", [{"foo": 1}]))
    with pytest.raises(DataError, match=r"x.jsonl:2: not a mc record"):
        load_task(
            write_jsonl(
                tmp_path / "x.jsonl",
                [{"context": "c", "choices": ["a"], "label": 0}, {"context": "c", "choices": ["a"], "label": "zero"}],
            )
        )


def test_piqa_labels_of_another_length_are_one_line(tmp_path):
    write_jsonl(tmp_path / "valid.jsonl", [{"goal": "g", "sol1": "a", "sol2": "b"}] * 3)
    (tmp_path / "valid-labels.lst").write_text("1\n0\n")
    with pytest.raises(DataError, match=r"valid-labels.lst: 2 labels for the 3 records of .*valid.jsonl; it needs"):
        load_task(tmp_path / "valid.jsonl")
    (tmp_path / "valid-labels.lst").write_text("1\n0\n1\n0\n")
    with pytest.raises(DataError, match=r"valid-labels.lst: 4 labels for the 3 records"):
        load_task(tmp_path / "valid.jsonl")
    (tmp_path / "valid-labels.lst").write_text("1\nzero\n1\n")
    with pytest.raises(DataError, match=r"valid-labels.lst: not one integer label a line"):
        load_task(tmp_path / "valid.jsonl")
