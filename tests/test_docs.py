"""The generated reference pages (docs/configs.md, docs/cli.md) match the code."""

from __future__ import annotations

import importlib.util

from conftest import REPO


def test_generated_reference_pages_are_up_to_date() -> None:
    spec = importlib.util.spec_from_file_location(
        "gen_reference", REPO / "docs" / "gen_reference.py"
    )
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    for name, render in gen.PAGES.items():
        committed = (REPO / "docs" / name).read_text()
        assert committed == render(), (
            f"docs/{name} is out of date: run .venv/bin/python docs/gen_reference.py"
        )
