"""Settings a user can read: every field in one section, the sections in order, and docs/configuration.md
listing each setting once, in its section, with the class's default and description."""

from __future__ import annotations

import re

from devtools.settings_reference import BEGIN, DOC, END, documented, group_of, render
from service.cli import serve_options
from service.config import GROUPS, Settings


def test_every_setting_is_in_one_section_and_the_sections_stand_in_order() -> None:
    keys = [key for key, _, _ in GROUPS]
    groups = {name: group_of(field) for name, field in Settings.model_fields.items()}
    assert {name: group for name, group in groups.items() if group not in keys} == {}
    assert [name for name, field in Settings.model_fields.items() if not field.description] == []
    # The class reads as the docs do: each section's fields together, sections in GROUPS' order.
    order = [keys.index(group) for group in groups.values() if group is not None]
    assert order == sorted(order)
    assert set(order) == set(range(len(keys)))  # no empty section


def test_every_serve_option_sets_a_setting() -> None:
    assert serve_options().keys() <= Settings.model_fields.keys()


def test_the_docs_list_each_setting_once_in_its_section_as_the_class_says() -> None:
    text = DOC.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    block = documented(text)
    # Regenerate with `.venv/bin/python -m devtools.settings_reference --write` after changing Settings.
    assert block == render()
    sections = re.split(r"^### ", block, flags=re.MULTILINE)[1:]
    assert [section.splitlines()[0] for section in sections] == [title for _, title, _ in GROUPS]
    for (key, _, _), section in zip(GROUPS, sections, strict=True):
        rows = [line for line in section.splitlines() if line.startswith("| `")]
        names = [name for name, field in Settings.model_fields.items() if group_of(field) == key]
        assert len(rows) == len(names)
        for name, row in zip(names, rows, strict=True):
            field = Settings.model_fields[name]
            assert field.description is not None and row.endswith(f"| {field.description} |")
    for name in Settings.model_fields:
        variable = f"`ROBEZ_{name.upper()}`"
        assert block.count(variable) <= 1, name  # once (the three OTEL_* ones have their own names)
