"""Operator access to running coordinators: find, show, resume, commit and roll back transactions.

The `txactors txn` commands are thin; the work is here so tests (and scripts) use it without a
CLI: async functions that ask the coordinator's admin subject (`txn.coord.<p>.admin`) and return
the protocol Structs, and pure functions that render them as rich tables or JSON.

Only a configured NATS server makes sense here: an embedded one would be fresh and empty, so
`admin_session` refuses to start one instead of answering "no transactions" about nothing.
"""

from __future__ import annotations

import asyncio
import enum
import math
import re
import secrets
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any, Final, TypeVar

import msgspec
from nats.aio.client import Client
from rich import box
from rich.table import Table
from rich.text import Text

from txactors import layout
from txactors.actors import RemoteActorRef
from txactors.config import ENV_VARS, NatsConfig
from txactors.connection import nats_session
from txactors.coordinator.lifecycle import TxnState
from txactors.errors import (
    ActorDeadError,
    AskTimeout,
    CommandError,
    ConfigError,
    NatsConnectError,
    TxActorsError,
)
from txactors.protocol import (
    CommitTransaction,
    Ended,
    ListTransactions,
    ResumeTransaction,
    RollbackTransaction,
    ShowTransaction,
    TransactionInfo,
    TransactionList,
)

R = TypeVar("R")

ADMIN_TIMEOUT: Final = 10.0
"""Seconds to wait for an answer; a commit is answered only once its messages are published."""

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


class CoordinatorUnavailable(TxActorsError):
    """No coordinator answered on a partition's admin subject: not running, or too busy."""


# -- connecting -----------------------------------------------------------------------------


def admin_config(url: str | None = None, environ: Mapping[str, str] | None = None) -> NatsConfig:
    """The NATS settings for admin commands: `url` (else NATS_URL) plus auth from the environment.

    Raises ConfigError when no server is configured: the coordinator's server must be named.
    """
    # One quick retry: an operator at a prompt wants "unreachable" in a second, not in five.
    config = NatsConfig.from_env(
        environ, url=url, name="txactors-admin", connect_retries=1, reconnect_time_wait=0.5
    )
    if config.embedded:
        raise ConfigError(
            f"no NATS server given: pass --url nats://host:4222 or set {ENV_VARS['url']} "
            "to the server the coordinator (`txactors coordinator`) runs on"
        )
    return config


@asynccontextmanager
async def admin_session(
    url: str | None = None, environ: Mapping[str, str] | None = None
) -> AsyncIterator[Client]:
    """A connection to the configured server (never an embedded one); see `admin_config`."""
    config = admin_config(url, environ)
    try:
        async with nats_session(config) as session:
            yield session.nc
    except NatsConnectError as exc:
        # nats_session's advice ends with "or unset NATS_URL to run an embedded server", which
        # is wrong here: keep its diagnosis (the first sentence), give the admin advice instead.
        diagnosis = str(exc).split(". Check that", 1)[0]
        raise NatsConnectError(
            f"{diagnosis}. Check --url / {ENV_VARS['url']} (the coordinator's server), that it "
            "is reachable, and the credentials"
        ) from exc


# -- asking ---------------------------------------------------------------------------------


async def _ask(nc: Client, partition: int, command: Any, reply_type: type[R], timeout: float) -> R:
    subject = layout.admin_subject(partition)
    ref = RemoteActorRef(nc, subject, reply_type)
    try:
        reply: R = await ref.ask(command, timeout=timeout)
    except ActorDeadError:
        raise CoordinatorUnavailable(
            f"no coordinator serves partition {partition} ({subject}); is `txactors coordinator` "
            "running on this NATS server, with this many --partitions?"
        ) from None
    except AskTimeout:
        raise CoordinatorUnavailable(
            f"the coordinator of partition {partition} did not answer within {timeout:g}s; "
            "it may be overloaded. A commit or rollback may still complete: check with "
            "`txactors txn show`"
        ) from None
    return reply


def _partition(txid: str, partitions: int) -> int:
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    return layout.partition_of(txid, partitions)


async def find_transactions(
    nc: Client,
    where: ListTransactions,
    *,
    partitions: int = 1,
    timeout: float = ADMIN_TIMEOUT,
) -> TransactionList:
    """Every partition's answer to `where` (its filters are applied by the coordinators),
    merged oldest first; at most `where.limit` of them, `more` counting the rest."""
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    replies = await asyncio.gather(
        *(_ask(nc, p, where, TransactionList, timeout) for p in range(partitions)),
        return_exceptions=True,
    )
    merged: list[TransactionInfo] = []
    more = 0
    for reply in replies:  # every partition answered or failed: report the lowest failing one
        if isinstance(reply, BaseException):
            raise reply
        merged.extend(reply.transactions)
        more += reply.more
    merged.sort(key=lambda info: (info.born, info.txid))
    if where.limit is not None and len(merged) > where.limit:
        more += len(merged) - where.limit
        merged = merged[: where.limit]
    return TransactionList(transactions=merged, more=more)


async def list_transactions(
    nc: Client,
    *,
    partitions: int = 1,
    states: Iterable[str] = (),
    timeout: float = ADMIN_TIMEOUT,
) -> list[TransactionInfo]:
    """Open and discarded transactions of every partition (optionally only in `states`),
    oldest first. Finished (committed, rolled back) ones are not kept, so never listed."""
    where = ListTransactions(states=list(states))
    found = await find_transactions(nc, where, partitions=partitions, timeout=timeout)
    return found.transactions


async def show(
    nc: Client, txid: str, *, partitions: int = 1, timeout: float = ADMIN_TIMEOUT
) -> TransactionInfo:
    """One open or discarded transaction; CommandError(not_found) names a finished one's state."""
    command = ShowTransaction(txid=txid)
    return await _ask(nc, _partition(txid, partitions), command, TransactionInfo, timeout)


async def resume(
    nc: Client,
    txid: str,
    *,
    partitions: int = 1,
    batch: str | None = None,
    timeout: float = ADMIN_TIMEOUT,
) -> Ended:
    """Back to PREPARED with a fresh check count, so the checker asks the producer again."""
    command = ResumeTransaction(txid=txid, batch=batch)
    return await _ask(nc, _partition(txid, partitions), command, Ended, timeout)


async def commit(
    nc: Client,
    txid: str,
    *,
    partitions: int = 1,
    batch: str | None = None,
    timeout: float = ADMIN_TIMEOUT,
) -> Ended:
    """Commit without the producer's token; answered once every message is published."""
    command = CommitTransaction(txid=txid, batch=batch)
    return await _ask(nc, _partition(txid, partitions), command, Ended, timeout)


async def rollback(
    nc: Client,
    txid: str,
    *,
    partitions: int = 1,
    batch: str | None = None,
    timeout: float = ADMIN_TIMEOUT,
) -> Ended:
    """Roll back without the producer's token; nothing of it is ever delivered."""
    command = RollbackTransaction(txid=txid, batch=batch)
    return await _ask(nc, _partition(txid, partitions), command, Ended, timeout)


# -- bulk -----------------------------------------------------------------------------------


class Resolution(enum.StrEnum):
    """What a bulk `txactors txn resolve` does to each transaction it matched."""

    RESUME = "resume"
    COMMIT = "commit"
    ROLLBACK = "rollback"


_RESOLVERS: Final = {
    Resolution.RESUME: resume,
    Resolution.COMMIT: commit,
    Resolution.ROLLBACK: rollback,
}

BULK_CONCURRENCY: Final = 16
"""Commands in flight at once: a commit is answered only once published, so a bulk commit of
thousands overlaps them, without flooding the coordinator's mailbox."""


class Resolved(msgspec.Struct, kw_only=True):
    """The outcome of one transaction of a bulk action: its new `state`, or why not."""

    txid: str
    state: str | None = None
    error: str | None = None
    """`<code>: <message>` as the coordinator refused it, or why it could not be asked."""


def new_batch_id() -> str:
    """The id a bulk action sends with each command (`batch`), logged by the coordinator."""
    return f"bulk-{secrets.token_hex(6)}"


async def resolve_all(
    nc: Client,
    txids: Iterable[str],
    resolution: Resolution,
    *,
    partitions: int = 1,
    batch: str | None = None,
    timeout: float = ADMIN_TIMEOUT,
) -> list[Resolved]:
    """Apply `resolution` to each transaction, BULK_CONCURRENCY at a time; one outcome per
    txid, in the order given. A refusal or an unreachable partition fails only its own."""
    act = _RESOLVERS[resolution]
    gate = asyncio.Semaphore(BULK_CONCURRENCY)

    async def one(txid: str) -> Resolved:
        async with gate:
            try:
                ended = await act(nc, txid, partitions=partitions, batch=batch, timeout=timeout)
            except CommandError as exc:
                return Resolved(txid=txid, error=f"{exc.code}: {exc.message}")
            except CoordinatorUnavailable as exc:
                return Resolved(txid=txid, error=str(exc))
            return Resolved(txid=txid, state=ended.state)

    return list(await asyncio.gather(*(one(txid) for txid in txids)))


_DURATION_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION: Final = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd])")


def parse_duration(text: str) -> float:
    """Seconds in `90`, `90s`, `10m`, `1h30m`, `2d 3h` (what `human_duration` prints);
    ValueError saying how to write one."""
    spaced = text.strip().lower()
    try:
        seconds = float(spaced)
    except ValueError:
        parts = _DURATION.findall(spaced)
        if not parts or _DURATION.sub("", spaced).strip():
            raise ValueError(
                f"{text!r} is not a duration: write seconds (90) or a number and a unit, "
                "s m h d, e.g. 10m, 1h30m, 2d"
            ) from None
        seconds = sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"{text!r} is not a duration: it must be a finite number >= 0")
    return seconds


# -- rendering ------------------------------------------------------------------------------


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
