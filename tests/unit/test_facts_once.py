"""Every name on the wire is spelled once, where it is owned: header names, stream and bucket
names and KV stream prefixes in `wire/layout.py`, JetStream API subjects there or in `nats/`.
Anywhere else a literal is a second copy that can drift: this test names it.

Read from the source with `ast`: docstrings and prose (a string with a blank in it, such as a
log or error text naming TXN_HALF) are not copies; a string that is exactly a header name, a
stream or bucket name, or a subject part (`KV_…`, `$JS.API…`) is."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from txactors.wire import layout

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("txactors", "spark_sinks")
LAYOUT = "txactors/wire/layout.py"
STREAM_NAMES = frozenset(
    {
        layout.half_stream(0),
        layout.op_stream(0),
        layout.DISCARD_STREAM,
        layout.CHECKPOINT_BUCKET,
        layout.LEASE_BUCKET,
        layout.META_BUCKET,
    }
)
HEADER_NAME = re.compile(r"(Txn|Nats)-[A-Z][A-Za-z0-9-]*")


def owners(literal: str) -> tuple[str, ...] | None:
    """The modules (path prefixes) allowed to spell `literal`; None when it names nothing."""
    if any(blank in literal for blank in " \n\t"):
        return None  # prose
    if HEADER_NAME.fullmatch(literal) or literal in STREAM_NAMES or literal.startswith("KV_"):
        return (LAYOUT,)
    if "$JS.API" in literal:
        return (LAYOUT, "txactors/nats/")
    return None


def strings(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, text) of the string constants of `tree` but docstrings (f-strings' literal parts
    included)."""
    docstrings: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        for statement in body if isinstance(body, list) else ():
            if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
                docstrings.add(id(statement.value))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or id(node) in docstrings:
            continue
        if isinstance(node.value, str):
            yield node.lineno, node.value


def copies(path: Path, source: str) -> list[str]:
    where = path.relative_to(ROOT).as_posix()
    found = []
    for line, text in strings(ast.parse(source)):
        allowed = owners(text)
        if allowed is not None and not where.startswith(allowed):
            found.append(f"{where}:{line}: {text!r} (owned by {', '.join(allowed)})")
    return found


def test_names_on_the_wire_are_spelled_only_where_they_are_owned() -> None:
    found = [
        copy
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for copy in copies(path, path.read_text())
    ]
    assert not found, "spelled outside the module that owns it:\n" + "\n".join(found)


def test_a_copy_is_named() -> None:
    source = "\n".join(
        [
            'HEADER = "Txn-Id"',
            'STREAM = f"KV_{bucket}"',
            "async def f(nc):",
            '    """$JS.API in a docstring"""',
            '    await nc.request("$JS.API.INFO", b"")',
            '    raise ValueError("TXN_HALF is prose here")',
        ]
    )
    found = copies(ROOT / "txactors/producer/example.py", source)
    assert [line.split(": ", 1)[1].split(" (")[0] for line in found] == [
        "'Txn-Id'",
        "'KV_'",
        "'$JS.API.INFO'",
    ]
    assert copies(ROOT / "txactors/nats/example.py", 'S = "$JS.API.INFO"\n') == []
