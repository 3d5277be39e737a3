"""`bench cpu` reads each role's instruction count from its callgrind output file."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from bench.callgrind import instructions
from bench.cpu import Measured, per_message, report, role_values, spread
from bench.transactions import CONCURRENCY

HEADER = """# callgrind format
version: 1
creator: callgrind-3.19.0
pid: 3109
cmd:  /usr/bin/nats-server -c nats-server.conf
part: 1

desc: Timerange: Basic block 0 - 10062958
desc: Trigger: Program termination

positions: line
"""

BODY = """
ob=(1) /usr/bin/nats-server
fl=(1) ???
fn=(1292) runtime.mapassign_fast64
0 2304
cfn=(616) internal/runtime/maps.memHash64AES
calls=128 0
0 896
"""


def test_totals_line_is_the_count_when_instrumentation_was_toggled() -> None:
    """Switched on and off with callgrind_control, the file says `summary: 0` in its head and
    the real count (callgrind_annotate's PROGRAM TOTALS) in `totals:` at its end."""
    text = HEADER + "events: Ir\nsummary: 0\n" + BODY + "\ntotals: 260724420\n"
    assert instructions(text) == 260_724_420


def test_summary_line_when_there_is_no_totals_line() -> None:
    assert instructions(HEADER + "events: Ir\nsummary: 1234\n" + BODY) == 1234


def test_the_ir_column_is_taken_among_several_events() -> None:
    text = HEADER + "events: Dr Ir Dw\n" + BODY + "totals: 5 77 9\n"
    assert instructions(text) == 77


def test_a_missing_trailing_cost_is_zero() -> None:
    """The format leaves out trailing zero costs."""
    assert instructions(HEADER + "events: Dr Ir\n" + BODY + "totals: 5\n") == 0


def test_the_parts_of_a_combined_file_add_up() -> None:
    part = "events: Ir\n" + BODY + "totals: {}\n"
    assert instructions(HEADER + part.format(100) + part.format(23)) == 123


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (HEADER + BODY, "neither totals"),
        (HEADER + "totals: 5\n", "before events"),
        (HEADER + "events: Dr\ntotals: 5\n", "not Ir"),
    ],
)
def test_a_file_without_an_instruction_count_is_refused(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        instructions(text)


def test_per_message_divides_each_roles_file_by_the_count(tmp_path: Path) -> None:
    (tmp_path / "producer.out").write_text(HEADER + "events: Ir\ntotals: 6400\n")
    (tmp_path / "nats-server.out").write_text(HEADER + "events: Ir\nsummary: 0\ntotals: 320\n")
    assert per_message(tmp_path, ["producer", "nats-server"], 64) == {
        "producer": 100.0,
        "nats-server": 5.0,
    }


def test_spread_is_the_range_over_the_mean() -> None:
    assert spread([99.0, 101.0]) == pytest.approx(0.02)
    assert spread([5.0]) == 0.0


def measured(per_message: dict[str, float], idle: dict[str, float]) -> Measured:
    return Measured(per_message, idle, window=10.0, seconds=30.0)


def test_role_values_per_role_all_roles_and_less_idle() -> None:
    runs = [
        measured({"producer": 100.0, "nats-server": 50.0}, {"producer": 10.0, "nats-server": 5.0}),
        measured({"producer": 110.0, "nats-server": 40.0}, {"producer": 20.0, "nats-server": 0.0}),
    ]
    assert role_values(runs, "producer") == [100.0, 110.0]
    assert role_values(runs, "all") == [150.0, 150.0]
    assert role_values(runs, "producer", less_idle=True) == [90.0, 90.0]
    assert role_values(runs, "coordinator") == []


def test_report_rows_give_the_ratio_and_leave_a_missing_role_blank() -> None:
    tx = {"producer": 300.0, "coordinator": 600.0}
    raw = {"producer": 100.0}
    runs = {
        (kind, c): [measured(counts, dict.fromkeys(counts, 0.0))]
        for kind, counts in (("txactors", tx), ("raw", raw))
        for c in CONCURRENCY
    }
    console = Console(width=200, record=True)
    console.print(report(runs, count=320, runs=1))
    text = console.export_text()
    assert "1, producer" in text and "3.0x" in text
    assert "1, coordinator" in text and "600" in text
    assert "9.0x" in text  # all: 900 against 100
