"""docs/configuration.md from the config dataclasses: every field with its type, default and docstring.

The docstring of a field is the string literal right after it in ``config/schema.py`` (read from the source with
``ast``, since Python keeps no runtime record of it). ``python -m anytrain.configdoc > docs/configuration.md``
regenerates the page; a unit test fails when the committed page differs from what this prints.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Any

from anytrain import config

HEADER = """# Configuration

A run is one YAML recipe (`configs/*.yaml`) plus dotted command-line overrides, e.g.
`anytrain train configs/tiny.yaml --train.steps 500 --model.args.n_layers 2`. Every field is validated when the
config loads (a wrong type, range or unknown name is one `error:` line naming the field), and the resolved config is
written to `RUN_DIR/config.yaml`, so a run directory records everything that changed numerics or speed.

This page is generated from `src/anytrain/config/schema.py` (`python -m anytrain.configdoc > docs/configuration.md`);
a test fails when it is out of date. `model.args` takes the fields of the model family's own args class
(`TransformerArgs`, `MambaArgs`, `Mamba2Args`, `HybridArgs` in `src/anytrain/models/`), on top of the chosen
`model.flavour`.

No environment variable changes what a run computes or how fast. The only ones anytrain reads are test fault
injections: `ANYTRAIN_TEST_KILL_AT_STEP` / `ANYTRAIN_TEST_KILL_RANK` (the process kills itself with SIGKILL at that
step, on that rank), `ANYTRAIN_TEST_NAN_AT_STEP` / `ANYTRAIN_TEST_NAN_RANK` (the loss turns NaN there; CUDA graphs
are then not captured), read by `train/guard.py`, and two read by `anytrain doctor`: `ANYTRAIN_TEST_CORRUPT_RANK`
(that rank corrupts one all_reduce element) and `ANYTRAIN_TEST_OVERLAP_RANK` (that rank reports the next rank's
sample ids in the data-partition check), and `ANYTRAIN_TEST_KILL_PREPARE_AT_CHUNK` (`anytrain prepare` kills itself
with SIGKILL after writing that chunk, before committing it; `data/prepare.py`).
"""


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring literal that follows its annotated assignment in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:] + [None], strict=True):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            if is_doc and isinstance(after.value.value, str):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return repr(f.default_factory())  # type: ignore[misc]
    return "(required)"


def _one_line(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def section_table(name: str, cls: type) -> list[str]:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    lines = [f"## `{name}`", ""]
    class_doc = inspect.getdoc(cls)
    if class_doc and not class_doc.startswith(cls.__name__ + "("):
        lines += [_one_line(class_doc), ""]
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):  # a sub-section (metrics.wandb): its own table after this one
            nested += section_table(f"{name}.{f.name}", hints[f.name])
            continue
        doc = _one_line(docs.get(f.name, ""))
        rows.append(f"| `{name}.{f.name}` | {_type_name(hints[f.name])} | `{_default(f)}` | {doc} |")
    if rows:
        lines += ["| field | type | default | meaning |", "|---|---|---|---|", *rows, ""]
    return lines + nested


def render() -> str:
    """The whole page: top-level fields, then one table per section of RunConfig."""
    hints = typing.get_type_hints(config.RunConfig)
    top_docs = field_docs(config.RunConfig)
    sections, top = [], ["## Top level", "", "| field | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(config.RunConfig):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            sections += section_table(f.name, tp)
        else:
            top.append(f"| `{f.name}` | {_type_name(tp)} | `{_default(f)}` | {_one_line(top_docs.get(f.name, ''))} |")
    return "\n".join([HEADER, *top, "", *sections]).rstrip() + "\n"


def main() -> None:
    print(render(), end="")


if __name__ == "__main__":
    main()
