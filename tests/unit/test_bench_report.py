"""docs/benchmarks.md's tables are what bench/report.py renders from bench/results/*.json, and
`python -m bench NAME --json DIR` writes what a benchmark printed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.table import Table

from bench import report
from bench.results import dumps, record, table_data


def test_the_page_is_what_the_results_render() -> None:
    page = report.PAGE.read_text()
    assert report.render(page, report.load()) == page, "run: python -m bench.report"


def test_every_results_file_says_where_its_figures_come_from() -> None:
    results = report.load()
    assert results
    for name, data in results.items():
        assert (report.RESULTS / f"{name}.json").exists()
        assert data["command"].startswith(("python3 dev.py bench ", "PYTHONPATH="))
        assert name in data["command"]
        assert data["date"] and data["machine"] and data["versions"]["nats-server"]
        for table in data["tables"]:
            assert all(len(row) == len(table["columns"]) for row in table["rows"])


def test_a_block_without_results_or_results_without_a_block_is_refused() -> None:
    results = {"wire": report.load()["wire"]}
    with pytest.raises(ValueError, match=r"without results: \['gone'\]"):
        report.render("<!-- results: gone -->\n<!-- /results -->", results)
    with pytest.raises(ValueError, match=r"results without a block: \['wire'\]"):
        report.render("no blocks", results)


def test_render_replaces_only_what_stands_between_the_markers() -> None:
    data = {
        "benchmark": "demo",
        "command": "python3 dev.py bench demo",
        "date": "2026-11-28",
        "commit": "abc1234",
        "machine": "2 cores",
        "versions": {"python": "3.11.7", "nats-server": "2.15.1"},
        "tables": [{"title": "t", "columns": ["measure", "a|b"], "rows": [["  sub", "1"]]}],
    }
    page = "before\n<!-- results: demo -->\nstale\n<!-- /results -->\nafter\n"
    assert report.render(page, {"demo": data}) == (
        "before\n<!-- results: demo -->\n**t**\n\n| measure | a\\|b |\n| --- | ---: |\n"
        "| … sub | 1 |\n\n*`python3 dev.py bench demo`, 2026-11-28 at `abc1234`; 2 cores; "
        "python 3.11.7, nats-server 2.15.1.*\n<!-- /results -->\nafter\n"
    )


def test_json_holds_the_printed_table_as_plain_text(tmp_path: Path) -> None:
    table = Table(title="[bold]rates[/bold]")
    table.add_column("measure")
    table.add_column("tx/s", justify="right")
    table.add_row("acked, 64", "[green]3,077[/green]")
    table.add_row("one-way, 64", "6,093")
    data = record("transactions", [table], quick=True)
    assert data["command"] == "python3 dev.py bench transactions --quick"
    assert data["tables"] == [table_data(table)]
    assert table_data(table) == {
        "title": "rates",
        "columns": ["measure", "tx/s"],
        "rows": [["acked, 64", "3,077"], ["one-way, 64", "6,093"]],
    }
    assert data["versions"]["nats-server"]
    assert json.loads(dumps(data)) == data
    assert '["acked, 64", "3,077"]' in dumps(data)
