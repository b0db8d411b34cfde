"""lm-eval's ``target_delimiter`` in anytrain task files (a first line ``{"target_delimiter": ""}`` for the file, a
``target_delimiter`` field per record), its checks, the lm-eval task YAML written for such a file, and the scorer's
sequence start (one end-of-text token) and window as lm-eval's HF model."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from anytrain.data.prepare import EOS, train_tokenizer
from anytrain.errors import DataError
from anytrain.evals.lm_eval_bridge import write_local_task
from anytrain.evals.tasks import Scorer, build_requests, load_task, norm_scores, score_task

TEXTS = ["the cat sat on the mat, and the dog sat too.", "But soft! what light?"] * 20


def write_lines(path, *records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


MC = {"context": "But soft", "choices": [",", " what", "!"], "label": 1}


def test_the_file_and_record_delimiters_go_between_context_and_choice(tmp_path):
    default = load_task(write_lines(tmp_path / "a.jsonl", MC))
    assert build_requests(default) == [("But soft", " ,"), ("But soft", "  what"), ("But soft", " !")]
    task = load_task(
        write_lines(
            tmp_path / "b.jsonl",
            {"target_delimiter": ""},
            MC,
            {**MC, "target_delimiter": "\n"},
            {**MC, "target_delimiter": None},
        )
    )
    assert len(task.items) == 3  # the first line is the file's options, not an item
    assert build_requests(task) == [
        ("But soft", ","),
        ("But soft", " what"),
        ("But soft", "!"),
        ("But soft", "\n,"),
        ("But soft", "\n what"),
        ("But soft", "\n!"),
        ("But soft", ","),
        ("But soft", " what"),
        ("But soft", "!"),
    ]
    # acc_norm divides by len(choice), the choice as given (its own leading space counts), never the delimiter
    assert all(item.choices == MC["choices"] for item in task.items)
    assert list(norm_scores([-1.0, -3.0, -0.5], task.items[0].choices)) == [-1.0, -0.6, -0.5]
    # the other formats and k-shot examples take it too
    arc = {"question": "Which is hot?", "choices": {"text": ["ice", "fire"], "label": ["A", "B"]}, "answerKey": "B"}
    assert build_requests(load_task(write_lines(tmp_path / "arc.jsonl", {"target_delimiter": "\t"}, arc))) == [
        ("Question: Which is hot?\nAnswer:", "\tice"),
        ("Question: Which is hot?\nAnswer:", "\tfire"),
    ]
    lambada = load_task(write_lines(tmp_path / "l.jsonl", {"target_delimiter": ""}, {"text": "to be or not to be"}))
    assert build_requests(lambada) == [("to be or not to", "be")]
    shots = load_task(write_lines(tmp_path / "k.jsonl", {"target_delimiter": ""}, MC, {**MC, "context": "Q"}))
    assert build_requests(shots, 1)[0] == ("Q what\n\nBut soft", ",")


def test_a_delimiter_that_is_not_a_string_is_one_line_naming_the_file_line_and_field(tmp_path):
    for lines, where in (
        (({"target_delimiter": 1}, MC), "x.jsonl:1"),
        ((MC, MC, {**MC, "target_delimiter": [" "]}), "x.jsonl:3"),
    ):
        with pytest.raises(DataError) as exc:
            load_task(write_lines(tmp_path / "x.jsonl", *lines))
        message = str(exc.value)
        assert len(message.splitlines()) == 1 and f"{where}: target_delimiter must be a string" in message, message
    with pytest.raises(DataError, match=r"x.jsonl: no records"):
        load_task(write_lines(tmp_path / "x.jsonl", {"target_delimiter": ""}))


def test_the_lm_eval_task_written_for_a_file_carries_its_delimiter(tmp_path):
    source = write_lines(tmp_path / "cloze.jsonl", {"target_delimiter": ""}, MC, MC)
    yaml = write_local_task("cloze", source, tmp_path).read_text()
    assert 'target_delimiter: ""\n' in yaml and f"test: {json.dumps(str(tmp_path / 'cloze.docs.jsonl'))}\n" in yaml
    assert (tmp_path / "cloze.docs.jsonl").read_text() == 2 * (json.dumps(MC) + "\n")  # without the options line
    same = write_lines(tmp_path / "same.jsonl", *[{**MC, "target_delimiter": "\n"}] * 2)
    assert 'target_delimiter: "\\n"\n' in write_local_task("same", same, tmp_path).read_text()
    assert (
        'target_delimiter: " "\n'
        in write_local_task("plain", write_lines(tmp_path / "p.jsonl", MC), tmp_path).read_text()
    )
    mixed = write_lines(tmp_path / "mixed.jsonl", {"target_delimiter": ""}, MC, {**MC, "target_delimiter": " "})
    with pytest.raises(DataError, match=r"mixed.jsonl:3: target_delimiter \" \", the first record's is \"\""):
        write_local_task("mixed", mixed, tmp_path)
    assert not (tmp_path / "mixed.yaml").exists()


@pytest.mark.parametrize("task", ["!function os.system", "a: b\nc", "plain"])
def test_the_task_name_and_path_are_written_as_plain_strings(tmp_path, task):
    """A task name or file path holding a YAML tag (lm-eval's loader runs ``!function``), a colon or a newline is one
    string in the task YAML: yaml.safe_load and lm-eval read back exactly the name and path given."""
    folder = tmp_path / "data: x\n!function os.system"
    folder.mkdir()
    source = write_lines(folder / "t.jsonl", {"target_delimiter": ""}, MC, MC)
    written = write_local_task(task, source, folder)
    config = yaml.safe_load(written.read_text())
    assert config["task"] == task and config["target_delimiter"] == ""
    assert config["dataset_kwargs"] == {"data_files": {"test": str(folder.resolve() / f"{task}.docs.jsonl")}}
    lm_eval_yaml = pytest.importorskip("lm_eval.tasks._yaml_loader")
    assert lm_eval_yaml.load_yaml(written) == config


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(iter(TEXTS), vocab_size=300)


def test_one_end_of_text_token_starts_every_sequence_as_lm_eval(tokenizer):
    eos = tokenizer.token_to_id(EOS)
    scorer = Scorer(lambda ids: torch.zeros(*ids.shape, 300), tokenizer, eos, max_len=64)
    ids = lambda text: tokenizer.encode(text).ids  # noqa: E731
    assert scorer.encode_pair("the cat", " sat") == ([eos] + ids("the cat"), ids(" sat"))
    assert scorer.encode_pair(EOS + "the cat", " sat") == ([eos] + ids("the cat"), ids(" sat"))  # not two
    assert scorer.encode_pair("", "the cat") == ([eos], ids("the cat"))
    assert scorer.encode_pair("", EOS + "the cat") == ([eos], ids("the cat"))  # lm-eval: that EOS is the context
    assert scorer.encode_pair("the cat ", "sat") == ([eos] + ids("the cat"), ids(" sat"))


def test_choices_are_scored_over_the_model_positions_and_perplexity_over_the_window(tmp_path, tokenizer):
    eos = tokenizer.token_to_id(EOS)
    table, by_position = torch.randn(2, 300, 300, generator=torch.Generator().manual_seed(0))
    model = lambda ids: table[ids] + by_position[: ids.shape[1]]  # noqa: E731 (B, T, V): sees positions
    long = ("the cat sat on the mat, and the dog sat too. " * 3, " But soft")
    assert len(tokenizer.encode(long[0] + long[1]).ids) > 16
    wide, narrow = Scorer(model, tokenizer, eos, max_len=64), Scorer(model, tokenizer, eos, max_len=16)
    windowed = Scorer(model, tokenizer, eos, max_len=64, window=16)
    assert windowed.loglikelihood([long]) == wide.loglikelihood([long]) != narrow.loglikelihood([long])
    text = tokenizer.encode(long[0] * 2).ids
    assert windowed.rolling_nll(text) == narrow.rolling_nll(text) != wide.rolling_nll(text)
    task = load_task(write_lines(tmp_path / "long.jsonl", {"context": long[0], "choices": ["But", "the"], "label": 0}))
    assert score_task(windowed, task) == score_task(wide, task)
