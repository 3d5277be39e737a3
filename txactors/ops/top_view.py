"""How `txactors top` draws a frame: one table of partitions (owner, open and discarded
transactions, rates), the dead letters of each group, the oldest open transactions, and what
could not be read. Pure: two snapshots in (the previous one for rates), a rich renderable out."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Final

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from txactors.ops.top import Snapshot, oldest, owners, rate, total
from txactors.ops.views import human_duration

DISCARDED: Final = frozenset({"discarded", "discarding"})
CHECKING: Final = "checking"
OLDEST_SHOWN: Final = 5

_RATES: Final = (
    ("commits/s", "txactors_commits_total"),
    ("rollbacks/s", "txactors_rollbacks_total"),
    ("check-backs/s", "txactors_checks_total"),
    ("inconclusive/s", "txactors_checks_inconclusive_total"),
)
_TOTALS: Final = (
    # shown as counts since each coordinator started; any of them above 0 wants a look
    ("group-check rb", "txactors_group_check_rollbacks_total"),
    ("discards", "txactors_discards_total"),
    ("quarantined", "txactors_quarantined_total"),
)


def render_top(
    previous: Snapshot | None, current: Snapshot, *, interval: float | None = None
) -> RenderableType:
    """One frame of `txactors top`: `current`, with rates since `previous`."""
    parts: list[RenderableType] = [
        _title(current, interval),
        _partitions(previous, current),
        Text(""),
        _dead_letters(previous, current),
        Text(""),
        _oldest(current),
    ]
    if not current.counts and not any("metrics" in p for p in current.problems):
        parts.append(
            Text(
                "rates and counts need the coordinators' metrics: --metrics "
                "http://HOST:PORT/metrics (each `txactors coordinator --metrics-port PORT`)",
                style="dim",
            )
        )
    parts.extend(Text(problem, style="bold red") for problem in current.problems)
    owner_of = owners(current)
    parts.extend(  # a partition with an owner that does not answer: say what was wrong
        Text(f"partition {view.partition}: {view.error}", style="bold red")
        for view in current.views
        if view.error is not None and owner_of.get(view.partition) is not None
    )
    return Group(*parts)


def _title(snapshot: Snapshot, interval: float | None) -> Text:
    at = time.strftime("%H:%M:%S", time.localtime(snapshot.taken_at))
    held = {p: o for p, o in owners(snapshot).items() if o is not None}
    count = (
        "no partition count published"
        if snapshot.partitions is None
        else (
            f"{snapshot.partitions} partition(s), {len(held)} held by "
            f"{len(set(held.values()))} coordinator(s)"
        )
    )
    every = f" · every {interval:g}s" if interval else ""
    return Text.assemble(("txactors top", "bold"), f" · {count} · {at}{every}")


def _table(title: str) -> Table:
    return Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False
    )


def _partitions(previous: Snapshot | None, current: Snapshot) -> Table:
    view = _table("partitions")
    view.add_column("partition", justify="right", no_wrap=True)
    view.add_column("owner", overflow="fold")
    for heading in ("open", "checking", "discarded", "oldest open"):
        view.add_column(heading, justify="right", no_wrap=True)
    for heading, _ in (*_RATES, *_TOTALS):
        view.add_column(heading, justify="right", no_wrap=True)
    owner_of = owners(current)
    sums = [0, 0, 0]
    for part in current.views:
        p = part.partition
        owner = owner_of.get(p)
        owner_cell = Text(owner) if owner else Text("no owner", style="bold red")
        rates = [_number(rate(previous, current, name, p)) for _, name in _RATES]
        totals = [_alarm(total(current, name, p)) for _, name in _TOTALS]
        if part.error is not None:
            view.add_row(
                str(p),
                owner_cell,
                Text("no answer", style="bold red"),
                "-",
                "-",
                "-",
                *rates,
                *totals,
            )
            continue
        txns = part.transactions
        discarded = sum(1 for t in txns if t.state in DISCARDED)
        counts = (len(txns) - discarded + part.more, sum(t.state == CHECKING for t in txns))
        sums = [sums[0] + counts[0], sums[1] + counts[1], sums[2] + discarded]
        born = [t.born for t in txns if t.state not in DISCARDED]
        age = human_duration(current.taken_at - min(born)) if born else "-"
        view.add_row(
            str(p),
            owner_cell,
            str(counts[0]),
            str(counts[1]),
            _alarm(discarded),
            age,
            *rates,
            *totals,
        )
    if len(current.views) > 1:
        view.add_section()
        every = range(current.partitions or 0)
        rates = [
            _number(_sum(rate(previous, current, name, p) for p in every)) for _, name in _RATES
        ]
        totals = [_alarm(_sum(total(current, name, p) for p in every)) for _, name in _TOTALS]
        view.add_row("all", "", str(sums[0]), str(sums[1]), _alarm(sums[2]), "", *rates, *totals)
    return view


def _dead_letters(previous: Snapshot | None, current: Snapshot) -> Table | Text:
    if not current.dead_letters:
        return Text("dead letters: no consumer group has a dead-letter stream", style="dim")
    view = _table("dead letters")
    view.add_column("group", overflow="fold")
    view.add_column("entries", justify="right", no_wrap=True)
    view.add_column("new/s", justify="right", no_wrap=True)
    before = {s.group: s.entries for s in previous.dead_letters} if previous else {}
    elapsed = current.taken_at - previous.taken_at if previous else 0.0
    for summary in current.dead_letters:
        grown = None
        if summary.group in before and elapsed > 0:
            grown = max(summary.entries - before[summary.group], 0) / elapsed
        view.add_row(summary.group, _alarm(summary.entries), _alarm(grown))
    return view


def _oldest(current: Snapshot) -> Table | Text:
    open_states = {t.state for part in current.views for t in part.transactions} - DISCARDED
    found = oldest(current.views, open_states, OLDEST_SHOWN)
    if not found:
        return Text("open transactions: none", style="dim")
    view = _table(f"oldest open transactions (up to {OLDEST_SHOWN})")
    for heading in ("txid", "partition", "group", "state", "age", "checks"):
        view.add_column(heading, no_wrap=heading != "txid", overflow="fold")
    for partition, info in found:
        view.add_row(
            info.txid,
            str(partition),
            info.group,
            info.state,
            human_duration(current.taken_at - info.born),
            str(info.check_times),
        )
    return view


def _sum(values: Iterable[float | None]) -> float | None:
    found = [v for v in values if v is not None]
    return sum(found) if found else None


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 or value == int(value) else f"{value:.1f}"


def _alarm(value: float | None) -> Text:
    """A count that should stay 0: red when it is not."""
    shown = _number(value)
    return Text(shown, style="bold red") if value else Text(shown)
