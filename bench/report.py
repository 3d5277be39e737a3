"""`python -m bench.report [--check]`: render bench/results/*.json into docs/benchmarks.md.

Each benchmark's tables go between `<!-- results: NAME -->` and `<!-- /results -->` in the
page, with the line saying which command, date, commit, machine and versions they came from;
the rest of the page is left as written. `--check` changes nothing and exits 1 when the page
is not what the JSON renders (tests/unit/test_bench_report.py checks the same).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.results import ROOT

RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
BLOCK = re.compile(r"(<!-- results: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)


def load(directory: Path = RESULTS) -> dict[str, dict[str, Any]]:
    """Every results file of `directory`, by benchmark name."""
    results = {}
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text())
        results[data["benchmark"]] = data
    return results


def _cell(text: str) -> str:
    return text.strip().replace("|", "\\|") or " "


def markdown_table(table: Mapping[str, Any]) -> str:
    """A table as Markdown: the first column left, the figures right."""
    columns = table["columns"]
    lines = [
        "| " + " | ".join(map(_cell, columns)) + " |",
        "| " + " | ".join(["---"] + ["---:"] * (len(columns) - 1)) + " |",
    ]
    for row in table["rows"]:
        first, *rest = row
        # a sub-row of the benchmark's own table is indented: keep that visible
        label = ("… " if first.startswith("  ") else "") + _cell(first)
        lines.append("| " + " | ".join([label, *map(_cell, rest)]) + " |")
    return "\n".join(lines) + "\n"


def provenance(data: Mapping[str, Any]) -> str:
    """Where the figures come from: command, date, commit, machine, versions, any note."""
    versions = ", ".join(f"{k} {v}" for k, v in data["versions"].items() if v)
    commit = f" at `{data['commit']}`" if data.get("commit") else ""
    note = f" {data['note']}" if data.get("note") else ""
    return f"*`{data['command']}`, {data['date']}{commit}; {data['machine']}; {versions}.*{note}\n"


def render_block(data: Mapping[str, Any]) -> str:
    parts = []
    for table in data["tables"]:
        if table.get("title"):
            parts.append(f"**{table['title']}**\n\n")
        parts.append(markdown_table(table) + "\n")
    return "".join(parts) + provenance(data)


def render(page: str, results: Mapping[str, Mapping[str, Any]]) -> str:
    """`page` with every results block rendered from `results`; a block without its JSON, or
    a JSON without its block, is an error (nothing on the page may be unaccounted for)."""
    names = [m["name"] for m in BLOCK.finditer(page)]
    missing = sorted(set(names) - set(results))
    unplaced = sorted(set(results) - set(names))
    if missing or unplaced:
        raise ValueError(f"blocks without results: {missing}; results without a block: {unplaced}")
    return BLOCK.sub(lambda m: m[1] + render_block(results[m["name"]]) + m[4], page)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args()
    page = PAGE.read_text()
    rendered = render(page, load())
    if args.check:
        if rendered != page:
            sys.exit(f"{PAGE} is not what bench/results renders: run python -m bench.report")
        return
    PAGE.write_text(rendered)


if __name__ == "__main__":
    main()
