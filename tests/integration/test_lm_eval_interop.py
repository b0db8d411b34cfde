"""The native multiple-choice scorer (``anytrain eval --tasks``), the lm-eval bridge (``--lm-eval``) and lm-eval's own
HF model (``HFLM``) on the HF export of the same tiny run score a cloze task item for item alike: with lm-eval's
``target_delimiter: ""`` (choices carrying their own leading space or punctuation), contexts longer than the run's
``data.seq_len`` (lm-eval's HF model truncates at the export's ``max_position_embeddings``) and a context that starts
with the end-of-text token (lm-eval's HF model adds no second one)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from anytrain.config import load_config
from anytrain.data.prepare import EOS
from tests.conftest import cli_in_process as cli

SEQ_LEN = 32  # data.seq_len of the run; the model has 256 positions
SPEECH = (
    "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him. The evil that men "
    "do lives after them; the good is oft interred with their bones; so let it be with Caesar. The noble Brutus "
    "hath told you Caesar was ambitious: if it were so, it was a grievous fault"
)
ITEMS = [
    {"context": "ROMEO. But soft", "choices": [",", " what", "!", "'s"], "label": 0},
    {"context": "JULIET. O Romeo, Romeo! wherefore art thou Romeo", "choices": ["?", " Deny", ",", "."], "label": 0},
    {"context": "To be, or not to be: that is the ", "choices": ["question", " answer", "point"], "label": 0},
    {"context": f"{EOS}HAMLET. Alas, poor Yorick", "choices": ["!", " I", "'s", ","], "label": 0},
    {"context": "KING LEAR. Blow, winds, and crack your cheeks", "choices": ["!", " rage", ";", "."], "label": 0},
    {"context": SPEECH, "choices": [",", " and", ".", "'s"], "label": 0},  # > SEQ_LEN tokens
    {"context": SPEECH + ", and grievously hath Caesar answer'd it", "choices": [".", " Here", ",", "!"], "label": 0},
    {"context": "MACBETH. Is this a dagger which I see before me", "choices": [",", " The", "?", "."], "label": 0},
    {"context": "PORTIA. The quality of mercy is not strain'd", "choices": [";", ",", " It", "."], "label": 0},
    {"context": "OTHELLO. It is the cause, it is the cause, my soul", "choices": ["!", ",", " Let", "--"], "label": 0},
]


def _lm_eval_lls(lm, folder: Path) -> dict[str, tuple[list[list[float]], dict]]:
    """{task: (lm-eval's per-choice log-likelihoods of every document, in order; its metrics)} of both tasks."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(folder), include_defaults=False)
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=["cloze_lm", "spaced_lm"],
        num_fewshot=0,
        task_manager=manager,
        log_samples=True,
        bootstrap_iters=0,
    )
    out = {}
    for task, samples in results["samples"].items():
        by_doc = {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in samples}
        out[task.removesuffix("_lm")] = [by_doc[i] for i in range(len(by_doc))], results["results"][task]
    return out


def _native_lls(scorer, path: Path) -> list[list[float]]:
    from anytrain.evals.tasks import build_requests, load_task

    task = load_task(path)
    lls = iter(ll for ll, _ in scorer.loglikelihood(build_requests(task)))
    return [[next(lls) for _ in item.continuations] for item in task.items]


@pytest.fixture(scope="module")
def scored(tmp_path_factory, small_data) -> dict:
    """Per-item log-likelihoods of the task with target_delimiter "" (``cloze``) and " " (``spaced``): native,
    bridge and HFLM."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("transformers")
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM

    from anytrain.checkpoint.export import export_hf
    from anytrain.evals.lm_eval_bridge import model_class, write_local_task
    from anytrain.evals.tasks import scorer_for_run
    from anytrain.train.trainer import run_training

    root = tmp_path_factory.mktemp("interop")
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
            str(SEQ_LEN),
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
    run_training(cfg, run_dir=str(root / "run"))
    export_hf(root / "run", root / "hf")
    records = "".join(json.dumps(r) + "\n" for r in ITEMS)
    (root / "cloze.jsonl").write_text('{"target_delimiter": ""}\n' + records)
    (root / "spaced.jsonl").write_text(records)
    folder = root / "lm_tasks"
    folder.mkdir()
    write_local_task("cloze_lm", root / "cloze.jsonl", folder)
    write_local_task("spaced_lm", root / "spaced.jsonl", folder)

    scorer, _, _ = scorer_for_run(root / "run")
    bridge = model_class()(scorer=scorer)
    model = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)
    hflm = HFLM(
        pretrained=model, tokenizer=str(root / "hf"), batch_size=4, add_bos_token=True, softmax_dtype=torch.float32
    )
    bridged, hf = _lm_eval_lls(bridge, folder), _lm_eval_lls(hflm, folder)
    out = {"root": root, "scorer": scorer}
    for name in ("cloze", "spaced"):
        out[name] = {
            "native": _native_lls(scorer, root / f"{name}.jsonl"),
            "bridge": bridged[name][0],
            "hflm": hf[name][0],
            "bridge_metrics": bridged[name][1],
        }
    return out


def _assert_same(a: list[list[float]], b: list[list[float]], tol: float) -> None:
    assert [len(x) for x in a] == [len(x) for x in b]
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert np.allclose(x, y, rtol=0, atol=tol), (i, ITEMS[i]["context"][:40], x, y)
        assert int(np.argmax(x)) == int(np.argmax(y)), (i, x, y)


def test_the_target_delimiter_changes_the_picks_and_native_equals_hflm_item_for_item(scored):
    from anytrain.evals.tasks import build_requests, load_task

    root = scored["root"]
    pairs = build_requests(load_task(root / "cloze.jsonl"))
    assert pairs[:4] == [("ROMEO. But soft", c) for c in [",", " what", "!", "'s"]]  # the choices as they are
    assert build_requests(load_task(root / "spaced.jsonl"))[0] == ("ROMEO. But soft", " ,")
    tokens = [len(scored["scorer"].encode(r["context"])) for r in ITEMS]
    assert max(tokens) > SEQ_LEN + 1 and max(tokens) < 200  # truncation at data.seq_len would change these items
    cloze, spaced = scored["cloze"], scored["spaced"]
    picks = [int(np.argmax(x)) for x in cloze["native"]]
    assert picks != [int(np.argmax(x)) for x in spaced["native"]]  # the delimiter changes the answer
    _assert_same(cloze["native"], cloze["hflm"], 1e-4)
    _assert_same(spaced["native"], spaced["hflm"], 1e-4)


def test_the_bridge_equals_the_native_scorer_item_for_item(scored, capsys):
    root, evals = scored["root"], scored["root"] / "run" / "evals"
    for name in ("cloze", "spaced"):
        _assert_same(scored[name]["native"], scored[name]["bridge"], 1e-5)
        _assert_same(scored[name]["bridge"], scored[name]["hflm"], 1e-4)  # lm-eval's prompts, either model

    # anytrain eval --tasks (the delimiter from the file's first line) gives the bridge's acc and acc_norm
    tasks = f"{root / 'cloze.jsonl'},{root / 'spaced.jsonl'}"
    code, out, err = cli(capsys, "eval", str(root / "run"), "--tasks", tasks)
    assert code == 0, err
    for name in ("cloze", "spaced"):
        native, bridged = json.loads((evals / f"{name}.json").read_text()), scored[name]["bridge_metrics"]
        assert (native["acc"], native["acc_norm"], native["n"]) == (bridged["acc,none"], bridged["acc_norm,none"], 10)

    # a bad delimiter is one line naming the file, line and field; exit 2; no result rewritten, not even the good
    # task's before it
    (root / "bad.jsonl").write_text('{"target_delimiter": 0}\n' + json.dumps(ITEMS[0]) + "\n")
    (evals / "cloze.json").write_text("earlier")
    code, out, err = cli(capsys, "eval", str(root / "run"), "--tasks", f"{root / 'cloze.jsonl'},{root / 'bad.jsonl'}")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {root / 'bad.jsonl'}:1: target_delimiter must be a string"), err
    assert (evals / "cloze.json").read_text() == "earlier"
