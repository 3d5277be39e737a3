"""How `txactors dlq` shows dead letters: the table of groups, a group's entries, one entry
in full (text as text, anything else as hex) and one line per replay."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Final

from rich import box
from rich.table import Table
from rich.text import Text

from txactors.ops.dlq import DeadLetterInfo, DeadLetterPage, DlqSummary, Replayed, entry_name
from txactors.ops.views import human_duration
from txactors.wire.layout import topic_stream


def render_summaries(summaries: Sequence[DlqSummary]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("group", no_wrap=True)
    table.add_column("entries", justify="right")
    table.add_column("first seq", justify="right")
    table.add_column("last seq", justify="right")
    for summary in summaries:
        table.add_row(
            summary.group,
            str(summary.entries),
            "-" if summary.first_seq is None else str(summary.first_seq),
            "-" if summary.last_seq is None else str(summary.last_seq),
        )
    return table


def render_list(page: DeadLetterPage, *, now: float | None = None) -> Table:
    """The `txactors dlq list GROUP` table, one row per entry."""
    now = time.time() if now is None else now
    shown = len(page.entries)
    title = f"{shown} of {page.total} dead letter(s), oldest first"
    if page.next_seq is not None:
        title += f"; more from --from {page.next_seq}"
    table = Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False
    )
    table.add_column("seq", justify="right", no_wrap=True)
    table.add_column("topic", no_wrap=True)
    table.add_column("msg id", overflow="fold")
    table.add_column("age", justify="right", no_wrap=True)
    table.add_column("tries", justify="right", no_wrap=True)
    table.add_column("stored", no_wrap=True)
    table.add_column("error", overflow="fold")
    for entry in page.entries:
        table.add_row(
            str(entry.seq),
            entry.topic,
            entry.msg_id or "-",
            human_duration(now - entry.stored_at),
            "-" if entry.deliveries is None else str(entry.deliveries),
            f"by reference ({entry.origin_stream} {entry.origin_seq})"
            if entry.omitted
            else f"{entry.size} B",
            entry.error or "-",
        )
    return table


def render_detail(entry: DeadLetterInfo, *, now: float | None = None) -> Table:
    """The `txactors dlq show GROUP SEQ` view: every header, then the body."""
    now = time.time() if now is None else now
    table = Table(show_header=False, box=None, title=f"{entry_name(entry.group, entry.seq)}")
    table.add_column("field", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    table.add_row("topic", entry.topic)
    table.add_row("stored", f"{human_duration(now - entry.stored_at)} ago")
    table.add_row("error", entry.error or "-")
    table.add_row("deliveries", "-" if entry.deliveries is None else str(entry.deliveries))
    table.add_row("original", f"{entry.origin_stream} seq {entry.origin_seq}")
    for name, value in entry.headers.items():
        table.add_row(Text(name, style="dim"), value)
    if entry.omitted:
        table.add_row("body", f"left out (stored by reference: {', '.join(entry.omitted)})")
    else:
        table.add_row("body", _body_text(entry.body or b""))
    return table


_BODY_SHOWN: Final = 4096


def _body_text(body: bytes) -> Text:
    """Text as it is (cut at 4 KiB), anything else as hex: a terminal is no place for bytes."""
    head = body[:_BODY_SHOWN]
    cut = f" … ({len(body)} bytes; --json for all)" if len(body) > _BODY_SHOWN else ""
    try:
        text = head.decode()
    except UnicodeDecodeError:
        text = None
    if text is not None and all(c.isprintable() or c in "\n\t" for c in text):
        return Text(text + cut)
    more = f" … ({len(body)} bytes; --json for all)" if len(body) > 256 else ""
    return Text(f"hex: {head[:256].hex(' ')}{more}")


def replay_line(result: Replayed, group: str) -> str:
    """Where a replayed entry went, as `txactors dlq replay` prints it (failures are errors)."""
    again = " (already there: an earlier replay)" if result.duplicate else ""
    return (
        f"{entry_name(group, result.seq)}: replayed to {topic_stream(result.topic or '')} seq "
        f"{result.topic_seq}{again}"
    )
