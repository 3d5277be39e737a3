"""How the operator commands show transactions and read and write times: the `txactors txn`
tables, durations in words (and back, for `--older-than`), and the protocol's JSON."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Final

import msgspec
from rich import box
from rich.table import Table
from rich.text import Text

from txactors.coordinator.core.states import TxnState
from txactors.errors import ConfigError
from txactors.wire.protocol import TransactionInfo

STATE_MEANINGS: Final[Mapping[TxnState, str]] = {
    TxnState.PREPARED: "halves stored, waiting for the producer's end or the next check-back",
    TxnState.CHECKING: "a check-back is in flight to the producer (or its group)",
    TxnState.COMMITTING: "commit decided; the decision record is being written",
    TxnState.PUBLISHING: "commit persisted; the messages are being published to their topics",
    TxnState.FINISHING: "all published; the `done` record is being written",
    TxnState.COMMITTED: "final: every message is on its topic",
    TxnState.ROLLING_BACK: "rollback decided; the decision record is being written",
    TxnState.ROLLED_BACK: "final: nothing was or will be delivered",
    TxnState.DISCARDING: "the checker gave up; the discard record is being written",
    TxnState.DISCARDED: (
        "the checker gave up (see discard reason); nothing is delivered unless an operator "
        "resumes, commits or rolls it back"
    ),
}
"""One line per state, for `txactors txn show` (docs/operations.md says the same)."""

_STATE_STYLES: Final[Mapping[str, str]] = {
    TxnState.CHECKING: "yellow",
    TxnState.DISCARDING: "red",
    TxnState.DISCARDED: "bold red",
    TxnState.COMMITTING: "green",
    TxnState.PUBLISHING: "green",
    TxnState.FINISHING: "green",
    TxnState.ROLLING_BACK: "magenta",
}
_NONE: Final = "-"


_DURATION_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION: Final = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd])")


def parse_duration(text: str) -> float:
    """Seconds in `90`, `90s`, `10m`, `1h30m`, `2d 3h` (what `human_duration` prints);
    ConfigError (a ValueError) saying how to write one."""
    spaced = text.strip().lower()
    try:
        seconds = float(spaced)
    except ValueError:
        parts = _DURATION.findall(spaced)
        if not parts or _DURATION.sub("", spaced).strip():
            raise ConfigError(
                f"{text!r} is not a duration: write seconds (90) or a number and a unit, "
                "s m h d, e.g. 10m, 1h30m, 2d"
            ) from None
        seconds = sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ConfigError(f"{text!r} is not a duration: it must be a finite number >= 0")
    return seconds


def to_json(value: msgspec.Struct | Sequence[msgspec.Struct]) -> str:
    """The Structs as JSON, exactly as the wire protocol spells them (for scripts)."""
    return msgspec.json.encode(value).decode()


def human_duration(seconds: float) -> str:
    """`42s`, `3m 12s`, `5h 07m`, `2d 3h`: precise enough to tell stuck from slow at a glance."""
    if seconds < 1:
        return "<1s" if seconds > 0 else "0s"
    whole = int(seconds)
    minutes, secs = divmod(whole, 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"


def next_check(info: TransactionInfo, now: float) -> str:
    """When the checker will next ask about it, relative to `now`."""
    if info.state == TxnState.CHECKING:
        return "in flight"
    if info.next_check_at is None:
        return _NONE
    wait = info.next_check_at - now
    return "due" if wait <= 0 else human_duration(wait)


def _state(state: str) -> Text:
    return Text(state, style=_STATE_STYLES.get(state, ""))


def render_list(transactions: Sequence[TransactionInfo], *, now: float | None = None) -> Table:
    """The `txactors txn list` table, one row per transaction."""
    now = time.time() if now is None else now
    table = Table(
        title=f"{len(transactions)} transaction(s), oldest first",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
    )
    table.add_column("txid", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("group", overflow="fold", min_width=6)
    table.add_column("topics", overflow="fold", min_width=6)
    table.add_column("age", justify="right", no_wrap=True)
    table.add_column("checks", justify="right", no_wrap=True)
    table.add_column("last check", overflow="fold")
    table.add_column("next check", justify="right", no_wrap=True)
    for info in transactions:
        table.add_row(
            info.txid,
            _state(info.state),
            info.group,
            "\n".join(info.topics),
            human_duration(now - info.born),
            str(info.check_times),
            info.last_check or _NONE,
            next_check(info, now),
        )
    return table


def _timestamp(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds")


def render_detail(info: TransactionInfo, *, now: float | None = None) -> Table:
    """The `txactors txn show` view: every field, with what the state means."""
    now = time.time() if now is None else now
    table = Table(show_header=False, box=None, title=f"transaction {info.txid}")
    table.add_column("field", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    try:
        meaning = STATE_MEANINGS[TxnState(info.state)]
    except ValueError:
        meaning = "unknown to this client; upgrade txactors"
    state = _state(info.state)
    state.append(f"  ({meaning})", style="dim")
    table.add_row("state", state)
    table.add_row("group", info.group)
    table.add_row("producer", info.producer)
    table.add_row("topics", ", ".join(info.topics))
    table.add_row("half seqs", ", ".join(map(str, info.half_seqs)))
    table.add_row("born", f"{_timestamp(info.born)} ({human_duration(now - info.born)} ago)")
    table.add_row("checks", str(info.check_times))
    table.add_row("last check", info.last_check or _NONE)
    when = next_check(info, now)
    if info.next_check_at is not None:
        when = f"{when} ({_timestamp(info.next_check_at)})"
    table.add_row("next check", when)
    if info.discard_reason is not None:
        table.add_row("discard reason", info.discard_reason)
    return table
