"""docs/configuration.md is generated from config/schema.py and every config field has a docstring."""

import dataclasses
import typing
from pathlib import Path

from anytrain import config
from anytrain.configdoc import field_docs, render

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_configuration_page_is_up_to_date():
    assert DOC.read_text() == render(), "docs/configuration.md is stale: python -m anytrain.configdoc > it"


def _undocumented(cls: type, prefix: str) -> list[str]:
    """Fields of ``cls`` and of its sub-sections (e.g. metrics.wandb) without a docstring."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    missing = [f"{prefix}{f.name}" for f in dataclasses.fields(cls) if not docs.get(f.name)]
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            missing += _undocumented(hints[f.name], f"{prefix}{f.name}.")
    return missing


def test_every_config_field_has_a_docstring():
    hints = typing.get_type_hints(config.RunConfig)
    missing = []
    for section in dataclasses.fields(config.RunConfig):
        if dataclasses.is_dataclass(hints[section.name]):
            missing += _undocumented(hints[section.name], f"{section.name}.")
    assert not missing, f"config fields without a docstring: {missing}"


def test_field_docs_reads_the_literal_after_each_field():
    @dataclasses.dataclass
    class Example:
        a: int = 1
        """first"""
        b: int = 2
        c: str = "x"
        """third
        continued"""

    assert field_docs(Example) == {"a": "first", "c": "third\ncontinued"}
