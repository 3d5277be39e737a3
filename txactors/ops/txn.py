"""Operator access to running coordinators: find, show, resume, commit and roll back transactions.

The `txactors txn` commands are thin; the work is here so tests (and scripts) use it without a
CLI: async functions that ask the coordinator's admin subject (`txn.coord.<p>.admin`) and return
the protocol Structs. How they are shown is `ops/views.py` (its names are importable from here).

Only a configured NATS server makes sense here: an embedded one would be fresh and empty, so
`admin_session` refuses to start one instead of answering "no transactions" about nothing.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Final, TypeVar

import msgspec
from nats.aio.client import Client

from txactors.actors import RemoteActorRef
from txactors.errors import (
    ActorDeadError,
    AskTimeout,
    CommandError,
    ConfigError,
    NatsConnectError,
    TxActorsError,
)
from txactors.nats.config import ENV_VARS, NatsConfig
from txactors.nats.connect import nats_session
from txactors.nats.partition_count import PartitionCountUnknown, client_count
from txactors.ops.views import (
    STATE_MEANINGS,
    human_duration,
    next_check,
    parse_duration,
    render_detail,
    render_list,
    to_json,
)
from txactors.wire import layout
from txactors.wire.protocol import (
    OPERATOR_DECISIONS,
    PROTOCOL_VERSION,
    Ended,
    ListTransactions,
    Resolution,
    ShowTransaction,
    TransactionInfo,
    TransactionList,
)

__all__ = [
    "ADMIN_TIMEOUT",
    "BULK_CONCURRENCY",
    "STATE_MEANINGS",
    "CoordinatorUnavailable",
    "Resolution",
    "Resolved",
    "admin_config",
    "admin_session",
    "commit",
    "decide",
    "find_transactions",
    "human_duration",
    "list_transactions",
    "new_batch_id",
    "next_check",
    "parse_duration",
    "render_detail",
    "render_list",
    "resolve_all",
    "resume",
    "rollback",
    "show",
    "to_json",
    "transaction_filter",
]

R = TypeVar("R")

ADMIN_TIMEOUT: Final = 10.0
"""Seconds to wait for an answer; a commit is answered only once its messages are published."""


class CoordinatorUnavailable(TxActorsError):
    """No coordinator answered on a partition's admin subject: not running, or too busy."""


# -- connecting -----------------------------------------------------------------------------


COORDINATORS_SERVER: Final = "the server the coordinators (`txactors coordinator`) run on"
"""Which server an operator names, in errors: the default, right for transactions, leases
and partitions; dead letters need no coordinator and say their own (`server=`)."""


def admin_config(
    url: str | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    server: str = COORDINATORS_SERVER,
) -> NatsConfig:
    """The NATS settings for admin commands: `url` (else NATS_URL) plus auth from the environment.

    Raises ConfigError when no server is configured: `server` says which one to name.
    """
    # One quick retry: an operator at a prompt wants "unreachable" in a second, not in five.
    config = NatsConfig.from_env(
        environ, url=url, name="txactors-admin", connect_retries=1, reconnect_time_wait=0.5
    )
    if config.embedded:
        raise ConfigError(
            f"no NATS server given: pass --url nats://host:4222 or set {ENV_VARS['url']} "
            f"to {server}"
        )
    return config


@asynccontextmanager
async def admin_session(
    url: str | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    server: str = COORDINATORS_SERVER,
) -> AsyncIterator[Client]:
    """A connection to the configured server (never an embedded one); see `admin_config`."""
    config = admin_config(url, environ, server=server)
    try:
        async with nats_session(config) as session:
            yield session.nc
    except NatsConnectError as exc:
        # nats_session's advice ends with "or unset NATS_URL to run an embedded server", which
        # is wrong here: keep its diagnosis (the first sentence), give the admin advice instead.
        diagnosis = str(exc).split(". Check that", 1)[0]
        raise NatsConnectError(
            f"{diagnosis}. Check --url / {ENV_VARS['url']} ({server}), that it is reachable, "
            "and the credentials"
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
            "running on this NATS server?"
        ) from None
    except AskTimeout:
        raise CoordinatorUnavailable(
            f"the coordinator of partition {partition} did not answer within {timeout:g}s; "
            "it may be overloaded. A commit or rollback may still complete: check with "
            "`txactors txn show`"
        ) from None
    return reply


async def _partition_count(nc: Client, partitions: int | None, timeout: float) -> int:
    """The coordinators' published partition count; `partitions`, if given, must equal it
    (txactors/nats/partition_count.py), and is used as it is while none is published."""
    try:
        return await client_count(nc, partitions, timeout)
    except PartitionCountUnknown as error:  # no coordinator ever ran here (or unreadable)
        raise CoordinatorUnavailable(str(error)) from None


async def _ask_owner(
    nc: Client, txid: str, command: Any, reply_type: type[R], partitions: int | None, timeout: float
) -> R:
    """Ask the coordinator of `txid`'s partition."""
    count = await _partition_count(nc, partitions, timeout)
    return await _ask(nc, layout.partition_of(txid, count), command, reply_type, timeout)


def transaction_filter(
    *,
    states: Iterable[str] = (),
    group: str | None = None,
    topic: str | None = None,
    older_than: float | None = None,
    limit: int | None = None,
) -> ListTransactions:
    """The query `find_transactions` sends (see `list_transactions` for the filters), in the
    protocol version this client speaks."""
    return ListTransactions(
        states=[str(state) for state in states],
        group=group,
        topic=topic,
        older_than=older_than,
        limit=limit,
        version=PROTOCOL_VERSION,
    )


async def find_transactions(
    nc: Client,
    where: ListTransactions,
    *,
    partitions: int | None = None,
    timeout: float = ADMIN_TIMEOUT,
) -> TransactionList:
    """Every partition's answer to `where` (its filters are applied by the coordinators),
    merged oldest first; at most `where.limit` of them, `more` counting the rest."""
    count = await _partition_count(nc, partitions, timeout)
    replies = await asyncio.gather(
        *(_ask(nc, p, where, TransactionList, timeout) for p in range(count)),
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
    states: Iterable[str] = (),
    group: str | None = None,
    topic: str | None = None,
    older_than: float | None = None,
    limit: int | None = None,
    partitions: int | None = None,
    timeout: float = ADMIN_TIMEOUT,
) -> list[TransactionInfo]:
    """Open and discarded transactions of every partition, oldest first; every filter given
    must hold: `states` (any of them, e.g. `TxnState.DISCARDED`), `group`, `topic` (one of its
    messages goes there), `older_than` (seconds since its first half), and at most `limit`
    (`find_transactions` also counts those left out). Finished (committed, rolled back) ones
    are not kept, so never listed."""
    where = transaction_filter(
        states=states, group=group, topic=topic, older_than=older_than, limit=limit
    )
    found = await find_transactions(nc, where, partitions=partitions, timeout=timeout)
    return found.transactions


async def show(
    nc: Client, txid: str, *, partitions: int | None = None, timeout: float = ADMIN_TIMEOUT
) -> TransactionInfo:
    """One open or discarded transaction; CommandError(not_found) names a finished one's state."""
    command = ShowTransaction(txid=txid, version=PROTOCOL_VERSION)
    return await _ask_owner(nc, txid, command, TransactionInfo, partitions, timeout)


async def decide(
    nc: Client,
    txid: str,
    resolution: Resolution,
    *,
    partitions: int | None = None,
    batch: str | None = None,
    timeout: float = ADMIN_TIMEOUT,
) -> Ended:
    """Carry out an operator's `resolution` of one transaction, without the producer's token:
    resume (back to PREPARED with a fresh check count, so the checker asks the producer
    again), commit (answered once every message is published) or roll back (nothing of it is
    ever delivered)."""
    command = OPERATOR_DECISIONS[resolution](txid=txid, batch=batch, version=PROTOCOL_VERSION)
    return await _ask_owner(nc, txid, command, Ended, partitions, timeout)


async def resume(
    nc: Client, txid: str, *, partitions: int | None = None, timeout: float = ADMIN_TIMEOUT
) -> Ended:
    """`decide(..., Resolution.RESUME)`: back to PREPARED with a fresh check count."""
    return await decide(nc, txid, Resolution.RESUME, partitions=partitions, timeout=timeout)


async def commit(
    nc: Client, txid: str, *, partitions: int | None = None, timeout: float = ADMIN_TIMEOUT
) -> Ended:
    """`decide(..., Resolution.COMMIT)`: answered once every message is on its topic."""
    return await decide(nc, txid, Resolution.COMMIT, partitions=partitions, timeout=timeout)


async def rollback(
    nc: Client, txid: str, *, partitions: int | None = None, timeout: float = ADMIN_TIMEOUT
) -> Ended:
    """`decide(..., Resolution.ROLLBACK)`: none of its messages is ever delivered."""
    return await decide(nc, txid, Resolution.ROLLBACK, partitions=partitions, timeout=timeout)


# -- bulk -----------------------------------------------------------------------------------

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
    partitions: int | None = None,
    batch: str | None = None,
    timeout: float = ADMIN_TIMEOUT,
) -> list[Resolved]:
    """Apply `resolution` to each transaction, BULK_CONCURRENCY at a time; one outcome per
    txid, in the order given. A refusal or an unreachable partition fails only its own."""
    command = OPERATOR_DECISIONS[resolution]
    count = await _partition_count(nc, partitions, timeout)  # read once for all of them
    gate = asyncio.Semaphore(BULK_CONCURRENCY)

    async def one(txid: str) -> Resolved:
        async with gate:
            try:
                ended = await _ask(
                    nc,
                    layout.partition_of(txid, count),
                    command(txid=txid, batch=batch, version=PROTOCOL_VERSION),
                    Ended,
                    timeout,
                )
            except CommandError as exc:
                return Resolved(txid=txid, error=f"{exc.code}: {exc.message}")
            except CoordinatorUnavailable as exc:
                return Resolved(txid=txid, error=str(exc))
            return Resolved(txid=txid, state=ended.state)

    return list(await asyncio.gather(*(one(txid) for txid in txids)))
