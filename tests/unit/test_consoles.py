"""Output into a pipe or a file is not wrapped at rich's 80 columns (`txactors/cli/consoles.py`),
and every console of the commands and the demos is made there."""

from __future__ import annotations

import ast
import io
import sys
from pathlib import Path

import pytest
from rich.table import Table

from txactors.cli.consoles import OFF_TERMINAL_WIDTH, console

ROOT = Path(__file__).resolve().parents[2]


def test_off_a_terminal_a_long_row_stays_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # a pipe, even under `pytest -s`
    table = Table("check", "expected")
    row = "alipay: money out = recorded transfers, every one of them, to the cent"
    table.add_row(row, "¥267.40")
    shown = console(file=io.StringIO())
    assert shown.width == OFF_TERMINAL_WIDTH
    with shown.capture() as captured:
        shown.print(table)
    assert any(row in line and "¥267.40" in line for line in captured.get().splitlines())


def test_columns_set_by_the_user_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    assert console(file=io.StringIO()).width == 100


def test_the_commands_and_demos_make_their_consoles_there() -> None:
    """A bare `rich.console.Console(...)` would wrap at 80 off a terminal (a quiet one prints
    nothing, so it may)."""
    bare = []
    for path in [*(ROOT / "txactors").rglob("*.py"), *(ROOT / "apps").rglob("*.py")]:
        if path.name == "consoles.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "Console"
                and not any(k.arg in ("quiet", "file") for k in node.keywords)
            ):
                bare.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert bare == []
