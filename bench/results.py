"""A benchmark's tables as JSON (`python -m bench NAME --json DIR` writes `DIR/NAME.json`).

Why: docs/benchmarks.md shows figures a user can trust only if they are what a run printed.
`bench/report.py` renders the page's tables from these files (bench/results/ holds the ones
the page shows), and a test checks the page against them, so the two cannot drift. Each file
says what produced it: the command, the date, the commit, the machine and the versions.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

ROOT = Path(__file__).resolve().parent.parent


def cell_text(cell: object) -> str:
    """A table cell as plain text (rich markup and styles dropped)."""
    if isinstance(cell, Text):
        return cell.plain
    if isinstance(cell, str):
        return Text.from_markup(cell).plain
    return str(cell)


def table_data(table: Table) -> dict[str, Any]:
    """A rich table as its title, column headers and rows of plain text."""
    columns = [list(map(cell_text, column.cells)) for column in table.columns]
    return {
        "title": cell_text(table.title or ""),
        "columns": [cell_text(column.header) for column in table.columns],
        "rows": [list(row) for row in zip(*columns, strict=True)],
    }


def _output(command: Sequence[str]) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=10, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def conditions() -> dict[str, Any]:
    """The machine, the versions and the commit a run happens on."""
    from txactors.embedded.server import find_nats_server_binary

    server = _output([str(find_nats_server_binary()), "--version"])
    return {
        "commit": _output(["git", "rev-parse", "--short", "HEAD"]),
        "machine": f"{os.cpu_count()} cores, {_cpu_model()}, {platform.system()}",
        "versions": {
            "python": platform.python_version(),
            "txactors": _version("txactors"),
            "nats-py": _version("nats-py"),
            "nats-server": server.removeprefix("nats-server: ").lstrip("v") if server else None,
        },
    }


def record(name: str, tables: Iterable[Table], *, quick: bool) -> dict[str, Any]:
    """What `--json` writes for one benchmark's run."""
    return {
        "benchmark": name,
        "command": f"python3 dev.py bench {name}{' --quick' if quick else ''}",
        "date": datetime.date.today().isoformat(),
        "quick": quick,
        **conditions(),
        "tables": [table_data(table) for table in tables],
    }


def dumps(data: dict[str, Any]) -> str:
    """Indented JSON with each list of plain values (a table row) on one line, for diffs."""
    text = json.dumps(data, indent=2, ensure_ascii=False)
    flat = re.sub(
        r"\[\n\s*([^\[\]{}]*?)\n\s*\]",
        lambda m: "[" + ", ".join(item.strip() for item in m[1].split(",\n")) + "]",
        text,
    )
    assert json.loads(flat) == data
    return flat + "\n"


def write(directory: Path, data: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{data['benchmark']}.json"
    path.write_text(dumps(data))
    return path
