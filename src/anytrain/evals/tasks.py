"""Downstream evaluation of a run: perplexity / bits-per-byte and in-context multiple-choice scoring.

``anytrain eval RUN --tasks TASKS`` (docs/evaluation.md). Each entry of TASKS is one of:

* ``val`` — perplexity and bits per byte on the run's prepared validation split (``--data`` for another);
* a prepared dataset folder (``index.json`` inside) — its validation split;
* a ``.txt`` file — perplexity and bits per byte of its text;
* a ``.jsonl`` file, or ``NAME`` for ``<task-dir>/NAME.jsonl`` — a multiple-choice or cloze task; the format is told
  from the first record's keys (``FORMATS``): anytrain's own ``{"context": str, "choices": [str], "label": int}``,
  HellaSwag, ARC, PIQA, BoolQ, Winogrande or LAMBADA as their authors (or the HF datasets) ship them, turned into
  prompts as lm-evaluation-harness does.

Scoring follows lm-evaluation-harness: each choice is a (context, continuation) pair, the continuation being the
target delimiter (lm-eval's ``target_delimiter``, " " unless the file or the record sets another) + the choice; its
score is the summed log-probability of the continuation's tokens given the context (the context's trailing spaces move
to the continuation; the pair is tokenized whole and the context's tokens split off). ``acc`` takes the best sum,
``acc_norm`` the best sum divided by ``len(choice)``: the characters (code points) of the choice string without the
target delimiter, exactly lm-eval's ``ConfigurableTask.process_results`` (``Item.choices``, ``norm_scores``). Every
sequence starts with one end-of-text token, as every document does in the prepared data (a context that already starts
with it gets no second one, as lm-eval's HF model). A sequence longer than the model's positions
(``model.args.max_seq_len``, which lm-eval's HF model reads from the export's config) keeps its last tokens. k-shot
prompts put k other items of the same file (drawn with a fixed seed) before the item, each as context + its correct
continuation, separated by a blank line.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from anytrain.errors import DataError

FEWSHOT_DELIMITER = "\n\n"
TARGET_DELIMITER = " "


# --------------------------------------------------------------------------------------------------------------------
# scoring


class Scorer:
    """Log-likelihoods, rolling NLL and greedy generation of a causal LM given token ids.

    ``model``: token ids (B, T) -> logits (B, T, V); ``tokenizer``: a ``tokenizers.Tokenizer``; sequences longer than
    ``max_len`` (the model's positions) keep their last ``max_len`` tokens (the continuation is always kept);
    ``rolling_nll`` scores windows of ``window`` tokens (default ``max_len``; a run's ``data.seq_len``)."""

    def __init__(
        self,
        model: Callable[[torch.Tensor], torch.Tensor],
        tokenizer: Any,
        eos_id: int,
        max_len: int,
        device: torch.device | str = "cpu",
        batch_size: int = 16,
        dtype: torch.dtype = torch.float32,
        window: int | None = None,
    ) -> None:
        self.model, self.tokenizer, self.eos_id, self.max_len = model, tokenizer, eos_id, max_len
        self.device, self.batch_size, self.dtype = torch.device(device), batch_size, dtype
        self.window = min(window or max_len, max_len)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids if text else []

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids with the leading EOS, continuation ids) as lm-eval's ``loglikelihood`` and ``_encode_pair``
        with its HF model's ``add_bos_token``: one EOS first, none added where the text already starts with it (an
        empty context takes that EOS as its context)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, head = self.encode(context + continuation), self.encode(context)
        if whole[:1] != [self.eos_id]:
            whole, head = [self.eos_id] + whole, [self.eos_id] + head
        split = max(len(head), 1)
        return whole[:split], whole[split:]

    @torch.no_grad()
    def _logits(self, rows: list[list[int]]) -> torch.Tensor:
        """log-softmax (B, T, V) in fp32 of right-padded rows (padding cannot reach earlier positions: causal)."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.eos_id, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
        enabled = self.dtype != torch.float32
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=enabled):
            logits = self.model(ids.to(self.device))
        return F.log_softmax(logits.float(), dim=-1)

    def loglikelihood(self, pairs: Iterable[tuple[str, str]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation tokens | context), whether greedy decoding gives the continuation) per pair."""
        encoded = [self.encode_pair(c, x) for c, x in pairs]
        rows = []
        for context, continuation in encoded:
            if not 0 < len(continuation) <= self.max_len:
                raise DataError(
                    f"a continuation of {len(continuation)} tokens cannot be scored (a choice or target "
                    f"is empty or longer than the model's {self.max_len} positions)"
                )
            rows.append((context + continuation)[-(self.max_len + 1) :])
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))  # similar lengths share a batch
        out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            logprobs = self._logits([rows[i][:-1] for i in batch])
            for b, i in enumerate(batch):
                n, row = len(encoded[i][1]), rows[i]
                span = logprobs[b, len(row) - 1 - n : len(row) - 1]  # (n, V): the positions predicting the tokens
                target = torch.tensor(row[-n:], device=span.device)
                ll = span.gather(-1, target[:, None]).sum().item()
                out[i] = (ll, bool((span.argmax(-1) == target).all()))
        return out

    def rolling_nll(self, ids: list[int]) -> tuple[float, int]:
        """(summed NLL in nats, tokens scored) of ``ids`` after a leading EOS, in disjoint windows of ``window``
        predicted tokens (each window sees only its own tokens: the first of each is predicted from the previous
        window's last token)."""
        ids = [self.eos_id] + list(ids)
        windows = [ids[s : s + self.window + 1] for s in range(0, len(ids) - 1, self.window)]
        total, count = 0.0, 0
        for start in range(0, len(windows), self.batch_size):
            batch = windows[start : start + self.batch_size]
            logprobs = self._logits([w[:-1] for w in batch])
            for b, window in enumerate(batch):
                target = torch.tensor(window[1:], device=logprobs.device)
                total -= logprobs[b, : len(target)].gather(-1, target[:, None]).sum().item()
                count += len(target)
        return total, count

    @torch.no_grad()
    def generate_until(self, context: str, until: list[str], max_new_tokens: int) -> str:
        """Greedy continuation of ``context``, cut before the first of ``until``."""
        ids = [self.eos_id] + self.encode(context)
        new: list[int] = []
        text = ""
        for _ in range(max_new_tokens):
            next_id = int(self._logits([(ids + new)[-self.max_len :]])[0, -1].argmax())
            if next_id == self.eos_id:
                break
            new.append(next_id)
            text = self.tokenizer.decode(new)
            if any(stop in text for stop in until):
                break
        for stop in until:
            text = text.split(stop)[0]
        return text


# --------------------------------------------------------------------------------------------------------------------
# task files


@dataclass
class Item:
    """One question: choice j is scored as ``contexts[j]`` (or ``contexts[0]`` when shared) followed by
    ``continuations[j]`` (the target delimiter + the choice); ``label`` is the correct choice. ``choices``: the strings
    lm-eval's ``doc_to_choice`` gives for the item, whose lengths in characters normalise ``acc_norm`` (the loaders
    give them; default: each continuation without a leading " "; Winogrande: the two contexts, as lm-eval's winogrande
    task)."""

    contexts: list[str]
    continuations: list[str]
    label: int
    choices: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.choices:
            self.choices = [c.removeprefix(TARGET_DELIMITER) for c in self.continuations]

    def context(self, j: int) -> str:
        return self.contexts[j if len(self.contexts) > 1 else 0]

    def shot(self) -> str:
        """The item as a solved example in a k-shot prompt."""
        return self.context(self.label) + self.continuations[self.label]


@dataclass
class Task:
    name: str
    format: str
    kind: str  # "multiple_choice" or "cloze" (one continuation; accuracy = greedy decoding reproduces it)
    items: list[Item] = field(default_factory=list)


def _choices(context: str, choices: list[str], label: int, delimiter: str) -> Item:
    return Item([context], [delimiter + c for c in choices], label, list(choices))


def _mc(doc: dict, delimiter: str) -> Item:
    return _choices(doc["context"], list(doc["choices"]), int(doc["label"]), delimiter)


def _hellaswag_text(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


def _hellaswag(doc: dict, delimiter: str) -> Item:
    context = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    query = _hellaswag_text(doc["activity_label"] + ": " + context)
    return _choices(query, [_hellaswag_text(e) for e in doc["endings"]], int(doc["label"]), delimiter)


def _arc(doc: dict, delimiter: str) -> Item:
    question = doc["question"]
    if isinstance(question, dict):  # AI2's jsonl: {"question": {"stem", "choices": [{"text", "label"}]}}
        texts = [c["text"] for c in question["choices"]]
        labels = [c["label"] for c in question["choices"]]
        question = question["stem"]
    else:  # HF datasets: {"question", "choices": {"text": [...], "label": [...]}}
        texts, labels = doc["choices"]["text"], doc["choices"]["label"]
    return _choices(f"Question: {question}\nAnswer:", texts, labels.index(doc["answerKey"]), delimiter)


def _piqa(doc: dict, delimiter: str) -> Item:
    return _choices(f"Question: {doc['goal']}\nAnswer:", [doc["sol1"], doc["sol2"]], int(doc["label"]), delimiter)


def _boolq(doc: dict, delimiter: str) -> Item:
    answer = doc["answer"] if "answer" in doc else doc["label"]
    prompt = f"{doc['passage']}\nQuestion: {doc['question']}?\nAnswer:"
    return _choices(prompt, ["no", "yes"], int(bool(answer)), delimiter)


def _winogrande(doc: dict, delimiter: str) -> Item:
    sentence = doc["sentence"]
    blank = sentence.index("_")
    target = delimiter + sentence[blank + 1 :].strip()
    contexts = [sentence[:blank] + option for option in (doc["option1"], doc["option2"])]
    return Item(contexts, [target, target], {"1": 0, "2": 1}[str(doc["answer"])], contexts)


def _lambada(doc: dict, delimiter: str) -> Item:
    words = doc["text"].split(" ")
    return Item([" ".join(words[:-1])], [delimiter + words[-1]], 0, [words[-1]])


FORMATS: dict[str, tuple[tuple[str, ...], str, Callable[[dict, str], Item]]] = {
    # format: (keys of a record that identify it, kind, (record, target delimiter) -> Item)
    "mc": (("context", "choices", "label"), "multiple_choice", _mc),
    "hellaswag": (("ctx_a", "ctx_b", "endings", "activity_label"), "multiple_choice", _hellaswag),
    "arc": (("question", "answerKey"), "multiple_choice", _arc),
    "piqa": (("goal", "sol1", "sol2"), "multiple_choice", _piqa),
    "boolq": (("passage", "question"), "multiple_choice", _boolq),
    "winogrande": (("sentence", "option1", "option2", "answer"), "multiple_choice", _winogrande),
    "lambada": (("text",), "cloze", _lambada),
}
FILE_OPTIONS = ("target_delimiter",)  # the keys of a task file's optional first line, {"target_delimiter": ""}


def detect_format(record: dict, where: str) -> str:
    for name, (keys, _, _) in FORMATS.items():
        if all(k in record for k in keys):
            return name
    raise DataError(
        f"{where}: first record has keys {sorted(record)}; expected those of one of "
        + "; ".join(f"{n} ({', '.join(k)})" for n, (k, _, _) in FORMATS.items())
    )


def _piqa_labels(path: Path) -> list[int] | None:
    """PIQA ships its labels beside the questions: train.jsonl + train-labels.lst."""
    lst = path.with_name(path.stem + "-labels.lst")
    if not lst.is_file():
        return None
    try:
        return [int(x) for x in lst.read_text().split()]
    except ValueError as exc:
        raise DataError(f"{lst}: not one integer label a line ({exc})") from None


def _delimiter(value: Any, default: str, where: str) -> str:
    if value is None:
        return default
    if not isinstance(value, str):
        got = f"{type(value).__name__} {json.dumps(value)}"
        raise DataError(f'{where}: target_delimiter must be a string (put before each choice: "" or " "), got {got}')
    return value


def read_records(path: str | Path) -> tuple[dict[str, Any], list[tuple[int, dict]]]:
    """(file options, [(line number, record)]) of a task file: one JSON object a line; a first line whose keys are
    all ``FILE_OPTIONS`` (``{"target_delimiter": ""}``) sets them for the whole file and is not an item."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: task file not found")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{number}: not a JSON object")
            records.append((number, record))
    options: dict[str, Any] = {}
    if records and records[0][1] and set(records[0][1]) <= set(FILE_OPTIONS):
        number, header = records.pop(0)
        where = f"{path}:{number}"
        options = {"target_delimiter": _delimiter(header.get("target_delimiter"), TARGET_DELIMITER, where)}
    if not records:
        raise DataError(f"{path}: no records")
    return options, records


def load_task(path: str | Path, name: str | None = None, limit: int = 0) -> Task:
    """A task file (JSONL, one record a line) as items; ``limit`` > 0 keeps the first ``limit``. Each choice is
    scored after the target delimiter: the record's ``target_delimiter``, else the file's (its first line), else " "."""
    path = Path(path)
    options, numbered = read_records(path)
    default = options.get("target_delimiter", TARGET_DELIMITER)
    records = [r for _, r in numbered]
    fmt = detect_format(records[0], str(path))
    if fmt == "piqa" and "label" not in records[0]:
        labels = _piqa_labels(path)
        if labels is None:
            raise DataError(f"{path}: PIQA records without labels and no {path.stem}-labels.lst beside them")
        if len(labels) != len(records):
            counts = f"{len(labels)} labels for the {len(records)} records of {path}"
            raise DataError(f"{path.parent / (path.stem + '-labels.lst')}: {counts}; it needs one label a record")
        records = [{**r, "label": y} for r, y in zip(records, labels, strict=True)]
    _, kind, convert = FORMATS[fmt]
    items = []
    for (number, _), record in zip(numbered, records, strict=True):
        delimiter = _delimiter(record.get("target_delimiter"), default, f"{path}:{number}")
        try:
            items.append(convert(record, delimiter))
        except (KeyError, ValueError, IndexError, TypeError) as exc:
            raise DataError(f"{path}:{number}: not a {fmt} record ({type(exc).__name__}: {exc})") from None
    return Task(name or path.stem, fmt, kind, items[:limit] if limit > 0 else items)


def fewshot_prefix(task: Task, index: int, k: int, seed: int) -> str:
    """The k solved examples before item ``index``: drawn from the other items of the task, the same for a given
    (seed, index) whatever the batch size or limit."""
    if k <= 0:
        return ""
    pool = [i for i in range(len(task.items)) if i != index]
    if len(pool) < k:
        raise DataError(f"{task.name}: --num-fewshot {k} needs at least {k + 1} items, the task has {len(task.items)}")
    shots = random.Random(seed * 1_000_003 + index).sample(pool, k)
    return "".join(task.items[i].shot() + FEWSHOT_DELIMITER for i in shots)


def build_requests(task: Task, k: int = 0, seed: int = 1234, count: int | None = None) -> list[tuple[str, str]]:
    """(context, continuation) of every choice of the first ``count`` items (all by default), in order; k-shot
    examples come from all the task's items."""
    pairs = []
    for index, item in enumerate(task.items[:count]):
        prefix = fewshot_prefix(task, index, k, seed)
        pairs.extend((prefix + item.context(j), cont) for j, cont in enumerate(item.continuations))
    return pairs


def norm_scores(lls: list[float], choices: list[str]) -> np.ndarray:
    """The scores ``acc_norm`` takes the best of: each log-likelihood over ``len(choice)``, the choice's characters
    without the target delimiter, in float64 — lm-eval 0.4's ``lls / completion_len`` in ``process_results`` (an empty
    choice gives -inf or nan there, and here). Not UTF-8 bytes, and not the length of the scored continuation
    ``" " + choice``: both can pick another choice (" a" at -1.0 beats " bbbb" at -3.8 per byte, not per character)."""
    lengths = np.array([float(len(c)) for c in choices])
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.array(lls, dtype=np.float64) / lengths


def score_task(scorer: Scorer, task: Task, k: int = 0, seed: int = 1234, limit: int = 0) -> dict[str, Any]:
    """Metrics of a multiple-choice task (acc, acc_norm) or a cloze task (acc, ppl) over its first ``limit`` items
    (all with 0); k-shot examples come from all the task's items."""
    count = min(limit, len(task.items)) if limit > 0 else len(task.items)
    items = task.items[:count]
    results = iter(scorer.loglikelihood(build_requests(task, k, seed, count)))
    correct = correct_norm = 0
    total_ll = 0.0
    for item in items:
        scores = [next(results) for _ in item.continuations]
        lls = [ll for ll, _ in scores]
        if task.kind == "cloze":
            correct += scores[0][1]
            total_ll += lls[0]
            continue
        correct += int(np.argmax(lls)) == item.label
        correct_norm += int(np.argmax(norm_scores(lls, item.choices))) == item.label
    n = len(items)
    if task.kind == "cloze":
        return {"acc": correct / n, "ppl": math.exp(-total_ll / n), "n": n}
    return {"acc": correct / n, "acc_norm": correct_norm / n, "n": n}


def text_metrics(scorer: Scorer, ids: list[int], num_bytes: int) -> dict[str, Any]:
    """Perplexity (per token) and bits per byte (summed NLL / ln 2 / UTF-8 bytes of the text) of token ids."""
    nll, tokens = scorer.rolling_nll(ids)
    return {
        "ppl": math.exp(min(nll / tokens, 50.0)),
        "bits_per_byte": nll / math.log(2) / num_bytes,
        "nll_per_token": nll / tokens,
        "tokens": tokens,
        "bytes": num_bytes,
    }


# --------------------------------------------------------------------------------------------------------------------
# a run


def scorer_for_run(
    run_dir: str | Path, checkpoint: str | Path | None = None, batch_size: int = 16, data: str | Path | None = None
):
    """(scorer on the best device, run config, checkpoint path, tokenizer file) for a run's newest checkpoint."""
    from anytrain import hardware
    from anytrain.checkpoint.run_model import load_run_model
    from anytrain.data.prepare import _eos_id, load_tokenizer
    from anytrain.evals import open_eval_data
    from anytrain.models import resolve_args

    device = hardware.resolve_device("auto")
    cfg, model, path = load_run_model(run_dir, device, checkpoint)
    tokenizer_file = open_eval_data(cfg, run_dir, data).tokenizer_path
    tokenizer = load_tokenizer(tokenizer_file)
    dtype = torch.bfloat16 if hardware.is_gpu(device) and hardware.supports_bf16(device) else torch.float32
    max_len = resolve_args(cfg.model).max_seq_len  # as lm-eval's HF model on the export (max_position_embeddings)
    eos_id, window = _eos_id(tokenizer, str(tokenizer_file)), max(cfg.data.seq_len, 1)
    scorer = Scorer(model, tokenizer, eos_id, max_len, device, batch_size, dtype, window=window)
    return scorer, cfg, path


def _text_task(scorer: Scorer, entry: str, path: Path | None, limit: int) -> dict[str, Any]:
    """Perplexity / bits per byte of a .txt file or of a prepared dataset's validation split (first ``limit``
    windows of the scorer's ``window`` when > 0)."""
    from anytrain.data.shards import INDEX, TokenDataset

    budget = limit * scorer.window if limit > 0 else None
    if path is not None and path.suffix == ".txt":
        text = path.read_text(encoding="utf-8")
        ids = scorer.encode(text)
        if not ids:
            raise DataError(f"--tasks {entry}: {path} holds no text")
        if budget is not None and len(ids) > budget:
            ids = ids[:budget]
            text = scorer.tokenizer.decode(ids)
        return {"format": "text", "file": str(path), **text_metrics(scorer, ids, len(text.encode("utf-8")))}
    if path is None or not (path / INDEX).is_file():
        raise DataError(f"--tasks {entry}: {path} is not a .txt file or a prepared dataset folder")
    split = TokenDataset(path).split("val")
    ids: list[int] = []
    for array in split.arrays:
        ids.extend(int(t) for t in array[: None if budget is None else budget - len(ids)])
        if budget is not None and len(ids) >= budget:
            break
    num_bytes = len(scorer.tokenizer.decode(ids).encode("utf-8"))  # the EOS separators are special: no bytes
    return {"format": "tokens", "file": str(path), **text_metrics(scorer, ids, max(num_bytes, 1))}


def resolve_entry(entry: str, task_dir: str | Path, data_path: str | Path) -> tuple[str, Path | None]:
    """(task name, file or folder) of one ``--tasks`` entry; NAME=PATH names a path."""
    name, _, target = entry.partition("=")
    if not target:
        name, target = "", entry
    if target == "val":
        return name or "val", Path(data_path)
    path = Path(target)
    if not path.exists() and (Path(task_dir) / f"{target}.jsonl").is_file():
        path = Path(task_dir) / f"{target}.jsonl"
    if not path.exists():
        raise DataError(
            f"--tasks {entry}: no file {path} (and no {Path(task_dir) / (target + '.jsonl')}); give a "
            ".jsonl / .txt path, a prepared dataset folder, val, or NAME with --task-dir"
        )
    return name or (path.stem if path.is_file() else path.name), path


def evaluate_tasks(
    run_dir: str | Path,
    tasks: list[str],
    num_fewshot: int = 0,
    limit: int = 0,
    batch_size: int = 16,
    task_dir: str | Path = "data/tasks",
    data: str | Path | None = None,
    seed: int = 1234,
    checkpoint: str | Path | None = None,
) -> list[dict[str, Any]]:
    """Score each task on the run's newest (or the given) checkpoint; each result also goes to
    ``RUN/evals/<task>.json``."""
    from anytrain.errors import ConfigError

    for flag, value in (("--num-fewshot", num_fewshot), ("--limit", limit)):
        if value < 0:
            raise ConfigError(f"{flag}: must be >= 0, got {value}")
    if batch_size <= 0:
        raise ConfigError(f"--batch-size: must be > 0, got {batch_size}")
    scorer, cfg, path = scorer_for_run(run_dir, checkpoint, batch_size, data)
    data_path = Path(data) if data is not None else Path(cfg.data.path)
    resolved = [resolve_entry(entry, task_dir, data_path) for entry in tasks]  # every entry checked first
    # every task file is read (and checked) before any result is written
    loaded = [load_task(t, n) if t is not None and t.suffix == ".jsonl" else None for n, t in resolved]
    results = []
    for (name, target), task in zip(resolved, loaded, strict=True):
        if task is not None:
            metrics = {
                "format": task.format,
                "file": str(target),
                "num_fewshot": num_fewshot,
                "seed": seed,
                **score_task(scorer, task, num_fewshot, seed, limit),
            }
        else:
            metrics = _text_task(scorer, name, target, limit)
        result = {
            "task": name,
            **metrics,
            "limit": limit,
            "checkpoint": str(path),
            "step": int(path.name.split("_")[-1]),
        }
        out = Path(run_dir) / "evals" / f"{name}.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        results.append(result)
    return results


def format_table(results: list[dict[str, Any]]) -> str:
    """One line per task: its metrics (acc, acc_norm, ppl, bits_per_byte) and item / token count."""
    header = f"{'task':<20} {'metric':<14} {'value':>10}  n"
    lines = [header, "-" * len(header)]
    for r in results:
        count = r.get("n", r.get("tokens"))
        for metric in ("acc", "acc_norm", "ppl", "bits_per_byte"):
            if metric in r:
                lines.append(f"{r['task']:<20} {metric:<14} {r[metric]:>10.4f}  {count}")
    return "\n".join(lines)
