"""lm-evaluation-harness bridge: an ``lm_eval`` model backed by an anytrain run (``pip install 'anytrain[eval]'``).

Registered as ``anytrain`` in lm-eval's model registry once this module is imported, so both work::

    anytrain eval RUN --lm-eval arc_easy --include-path my_tasks/ --num-fewshot 5
    lm_eval --model anytrain --model_args run=RUN --tasks arc_easy --include_path my_tasks/   (after an import hook)

The scoring is ``evals.tasks.Scorer``'s, the same as ``anytrain eval --tasks``: lm-eval builds the prompts, the
bridge tokenizes (a leading end-of-text token, lm-eval's context/continuation split) and scores them. Offline use
needs task YAMLs whose data are local files (``dataset_path: json`` with ``dataset_kwargs.data_files``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from anytrain.errors import AnytrainError, DataError

EVAL_INSTALL_HINT = "pip install 'anytrain[eval]'"


LOCAL_TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: {delimiter}
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def write_local_task(task: str, jsonl: str | Path, folder: str | Path) -> Path:
    """``folder/<task>.yaml``: an lm-eval multiple-choice task over a local JSONL file in anytrain's task schema
    (``context``, ``choices``, ``label``), for ``--include-path folder`` offline (docs/evaluation.md). The file's target
    delimiter (its first line, or the same ``target_delimiter`` in every record) becomes the task's; a file with a
    first line of options is read by lm-eval from ``folder/<task>.docs.jsonl``, its records without that line."""
    from anytrain.evals.tasks import TARGET_DELIMITER, load_task, read_records

    jsonl = Path(jsonl).resolve()
    load_task(jsonl)  # every record checked (format, target_delimiter) as anytrain eval --tasks would
    options, records = read_records(jsonl)
    default = options.get("target_delimiter", TARGET_DELIMITER)
    delimiters = [(number, record.get("target_delimiter", default)) for number, record in records]
    delimiter = delimiters[0][1]
    for number, other in delimiters:
        if other != delimiter:
            raise DataError(
                f"{jsonl}:{number}: target_delimiter {json.dumps(other)}, the first record's is "
                f"{json.dumps(delimiter)}; an lm-eval task has one: set it on the file's first line"
            )
    docs = jsonl
    if options:  # lm-eval would read the options line as a document
        docs = Path(folder).resolve() / f"{task}.docs.jsonl"
        if docs == jsonl:
            raise DataError(f"{jsonl}: write_local_task would overwrite the task file; give another task name")
        docs.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for _, r in records), encoding="utf-8")
    path = Path(folder) / f"{task}.yaml"
    # each value a JSON string (a YAML double-quoted scalar): a name or path is never read as a tag (lm-eval's loader
    # runs ``!function``), a mapping or a second line
    text = LOCAL_TASK_YAML.format(task=json.dumps(task), path=json.dumps(str(docs)), delimiter=json.dumps(delimiter))
    path.write_text(text, encoding="utf-8")
    return path


def _lm_eval():
    try:
        import lm_eval
        from lm_eval.api.model import LM
        from lm_eval.api.registry import register_model
    except ImportError:
        raise AnytrainError(f"--lm-eval needs lm-evaluation-harness: {EVAL_INSTALL_HINT}") from None
    return lm_eval, LM, register_model


def model_class() -> type:
    """The ``lm_eval.api.model.LM`` subclass (defined on first use, so that anytrain imports without lm-eval)."""
    global _MODEL_CLASS
    if _MODEL_CLASS is not None:
        return _MODEL_CLASS
    _, LM, register_model = _lm_eval()

    @register_model("anytrain")
    class AnytrainLM(LM):
        """An anytrain run's checkpoint as an lm-eval model: ``AnytrainLM(run=RUN_DIR, checkpoint=None,
        batch_size=16)``, or ``AnytrainLM(scorer=Scorer)`` around a model already loaded."""

        def __init__(
            self,
            run: str | None = None,
            checkpoint: str | None = None,
            batch_size: int | str = 16,
            scorer: Any = None,
            **_: Any,
        ) -> None:
            super().__init__()
            if scorer is None:
                from anytrain.evals.tasks import scorer_for_run

                if run is None:
                    raise AnytrainError("the anytrain lm-eval model needs run=RUN_DIR (model_args)")
                scorer, _, _ = scorer_for_run(run, checkpoint, int(batch_size))
            self.scorer = scorer

        @classmethod
        def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> AnytrainLM:
            args = dict(kv.split("=", 1) for kv in arg_string.split(",") if kv)
            extra = {k: v for k, v in (additional_config or {}).items() if k == "batch_size" and v is not None}
            return cls(**args, **extra)

        @property
        def eot_token_id(self) -> int:
            return self.scorer.eos_id

        @property
        def max_length(self) -> int:
            return self.scorer.max_len

        def loglikelihood(self, requests: list) -> list[tuple[float, bool]]:
            return self.scorer.loglikelihood([req.args[:2] for req in requests])

        def loglikelihood_rolling(self, requests: list) -> list[float]:
            return [-self.scorer.rolling_nll(self.scorer.encode(req.args[0]))[0] for req in requests]

        def generate_until(self, requests: list) -> list[str]:
            out = []
            for req in requests:
                context, options = req.args[0], dict(req.args[1])
                until = options.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                out.append(self.scorer.generate_until(context, until, int(options.get("max_gen_toks", 256))))
            return out

    _MODEL_CLASS = AnytrainLM
    return AnytrainLM


_MODEL_CLASS: type | None = None


def run_lm_eval(
    scorer: Any,
    tasks: list[str],
    include_path: str | Path | None = None,
    num_fewshot: int = 0,
    limit: int = 0,
    seed: int = 1234,
    builtin_tasks: bool = True,
) -> dict[str, dict]:
    """lm-eval's ``simple_evaluate`` of ``tasks`` on the scorer's model: {task: {metric: value}} (the ``,none``
    filter suffix dropped, standard errors left out). ``builtin_tasks`` False indexes only ``include_path`` (lm-eval
    spends ~30 s indexing its thousands of built-in task YAMLs on a small CPU machine)."""
    lm_eval, _, _ = _lm_eval()
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise AnytrainError(f"--include-path: {include_path} is not a folder")
    manager = TaskManager(include_path=str(include_path) if include_path else None, include_defaults=builtin_tasks)
    model = model_class()(scorer=scorer)
    try:
        results = lm_eval.simple_evaluate(
            model=model,
            tasks=tasks,
            num_fewshot=num_fewshot,
            limit=limit or None,
            task_manager=manager,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    except (KeyError, ValueError) as exc:  # lm-eval's "task not found" and config errors
        raise AnytrainError(f"--lm-eval: {exc}".splitlines()[0]) from None
    table = {}
    for task, metrics in results["results"].items():
        kept = {k.split(",")[0]: v for k, v in metrics.items() if isinstance(v, int | float) and "stderr" not in k}
        kept["n"] = kept.pop("sample_len", None)
        table[task] = kept
    return table
