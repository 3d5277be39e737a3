"""Reconciliation results and progress bars, rendered the same way by every demo.

A reconciliation is a list of `Check`s, each an expected and an actual number: the table
says at a glance what was proven, and any mismatch is a red row and a non-zero exit. Checks
are about the books, the deliveries and the pipeline only. What happened on the way (how
many operations committed, how many were refused or rolled back and why, what the fault
injector did) is a list of `Tally` rows, shown first and never a mismatch: how many
duplicates a run produced depends on timing, whether the books are right does not. It is
also published as a plain (non-transactional) JetStream message on a reconciliation topic,
so monitoring (or the Spark sink) can read every run's verdict.
"""

from __future__ import annotations

import time

import msgspec
from nats.aio.client import Client
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from txactors.nats.topics import ensure_topic_stream
from txactors.wire import layout

RECONCILIATION_TOPIC = "reconciliation"


class Check(msgspec.Struct, frozen=True, kw_only=True):
    """One proven fact: `actual` must equal `expected` (or reach it, with `at_least`)."""

    section: str
    name: str
    expected: int
    actual: int
    money: bool = False
    """Amounts in cents: shown as currency."""
    at_least: bool = False

    @property
    def ok(self) -> bool:
        return self.actual >= self.expected if self.at_least else self.actual == self.expected


class Tally(msgspec.Struct, frozen=True, kw_only=True):
    """A count of what happened in the run, reported as it is: how operations ended (by
    cause), or what a fault injector did. Not a check: no count here is a mismatch."""

    section: str
    name: str
    count: int


class Reconciliation(msgspec.Struct, frozen=True, kw_only=True):
    app: str
    checks: list[Check]
    tallies: list[Tally] = msgspec.field(default_factory=list)
    at: float = msgspec.field(default_factory=time.time)

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    @property
    def mismatches(self) -> list[Check]:
        return [check for check in self.checks if not check.ok]


def _number(value: int, money: bool) -> str:
    return f"¥{value / 100:,.2f}" if money else f"{value:,}"


def render(reconciliation: Reconciliation, title: str) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAVY)
    table.add_column("", style="dim")
    table.add_column("check")
    table.add_column("expected", justify="right")
    table.add_column("actual", justify="right")
    table.add_column("", justify="center")
    section = None
    for check in reconciliation.checks:
        expected = _number(check.expected, check.money)
        table.add_row(
            check.section if check.section != section else "",
            check.name,
            f"≥ {expected}" if check.at_least else expected,
            _number(check.actual, check.money),
            "[green]✓[/]" if check.ok else "[bold red]✗ MISMATCH[/]",
            end_section=False,
        )
        section = check.section
    return table


def render_tallies(reconciliation: Reconciliation, title: str = "what happened") -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAVY)
    table.add_column("", style="dim")
    table.add_column("what")
    table.add_column("count", justify="right")
    section = None
    for tally in reconciliation.tallies:
        table.add_row(
            tally.section if tally.section != section else "", tally.name, f"{tally.count:,}"
        )
        section = tally.section
    return table


def verdict(reconciliation: Reconciliation) -> str:
    if reconciliation.ok:
        return f"[bold green]reconciled: {len(reconciliation.checks)} checks, 0 mismatches[/]"
    return f"[bold red]{len(reconciliation.mismatches)} MISMATCHES[/]"


def show(
    console: Console,
    reconciliation: Reconciliation,
    *,
    drained: bool = True,
    drain_timeout: float = 0.0,
    title: str = "reconciliation",
) -> None:
    """What happened, the checks, then the verdict: what both demos print at the end of a
    run."""
    if reconciliation.tallies:
        console.print(render_tallies(reconciliation))
    console.print(render(reconciliation, title))
    if not drained:
        console.print(f"[red]the pipeline did not drain within {drain_timeout:g}s[/]")
    console.print(verdict(reconciliation))


async def publish(
    nc: Client, reconciliation: Reconciliation, topic: str = RECONCILIATION_TOPIC
) -> int:
    """Publish the result on `topic` (tag = the app) as a plain JetStream message (msgpack);
    returns its stream sequence."""
    js = nc.jetstream()
    await ensure_topic_stream(js, topic)
    ack = await js.publish(
        layout.topic_subject(topic, reconciliation.app), msgspec.msgpack.encode(reconciliation)
    )
    return ack.seq


def progress_bar(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description:<28}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )
