"""Is a demo's pipeline empty? Waiting for it before reconciling, and proving it after.

Drained means: no transaction of the demo's producer groups is open at the coordinator
(every one committed, rolled back or discarded; a committed one's messages are on their
topics before that) and every consumer group has acked everything on its topic (nothing
pending, nothing awaiting an ack or a retry). Only then do the databases say everything they
will ever say. Only the demo's own groups count: other users of a shared server do not.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

import anyio
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from apps.common.report import Check
from txactors.coordinator.core.states import TxnState
from txactors.ops.txn import CoordinatorUnavailable, find_transactions
from txactors.wire import layout
from txactors.wire.protocol import PROTOCOL_VERSION, ListTransactions


async def open_transactions(
    nc: Client, group: str | None = None, *, partitions: int | None = None
) -> int:
    """Transactions (of producer group `group`, or all) not yet in a final state (discarded
    is final for the checker)."""
    found = await find_transactions(
        nc, ListTransactions(group=group, version=PROTOCOL_VERSION), partitions=partitions
    )
    return sum(info.state != TxnState.DISCARDED for info in found.transactions)


async def discarded_transactions(nc: Client, group: str, *, partitions: int | None = None) -> int:
    where = ListTransactions(group=group, states=[TxnState.DISCARDED], version=PROTOCOL_VERSION)
    return len((await find_transactions(nc, where, partitions=partitions)).transactions)


async def unhandled_messages(nc: Client, topic: str, group: str) -> int:
    """Messages of `topic` that consumer group `group` has not acked yet."""
    info = await nc.jetstream().consumer_info(layout.topic_stream(topic), group)
    return int(info.num_pending or 0) + int(info.num_ack_pending or 0)


async def dead_letters(nc: Client, group: str) -> int:
    try:
        return int((await nc.jetstream().stream_info(layout.dlq_stream(group))).state.messages)
    except NotFoundError:
        return 0


async def wait_drained(
    nc: Client,
    groups: Sequence[tuple[str, str]],
    *,
    timeout: float,
    producer_group: str | Sequence[str] | None = None,
    also: Callable[[], Awaitable[bool]] | None = None,
    poll: float = 0.1,
    partitions: int | None = None,
) -> bool:
    """Wait until drained (see the module docstring) for every `(topic, consumer group)`
    and `producer_group` (None: every group; several: each), and `also()` is true; False if
    that did not happen within `timeout` seconds. A coordinator that does not serve yet (just
    restarted, waiting for its old lease to expire) is not drained yet, not an error. Groups
    are read in the order given, transactions first: a consumer group whose handler sends
    (a chain) goes before the group its messages reach, so no message can appear behind a
    count already read."""
    producer_groups = [producer_group] if isinstance(producer_group, str | None) else producer_group
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            still_open = 0
            for group in producer_groups:
                still_open += await open_transactions(nc, group, partitions=partitions)
        except CoordinatorUnavailable:  # restarted, not serving yet (a lease still expiring)
            still_open = None
        if still_open == 0:
            counts = [await unhandled_messages(nc, topic, group) for topic, group in groups]
            if not any(counts) and (also is None or await also()):
                return True
        await anyio.sleep(poll)
    return False


async def pipeline_checks(
    nc: Client, producer_group: str | Sequence[str], groups: Sequence[tuple[str, str]]
) -> list[Check]:
    """The reconciliation's "pipeline" rows: nothing open, discarded, unhandled or
    dead-lettered (a run that did not drain shows here as a mismatch), for each producer
    group (named in its rows when there are several)."""
    producer_groups = [producer_group] if isinstance(producer_group, str) else producer_group
    checks = []
    for producer in producer_groups:
        of = f"{producer}: " if len(producer_groups) > 1 else ""
        checks += [
            Check(
                section="pipeline",
                name=f"{of}transactions still open",
                expected=0,
                actual=await open_transactions(nc, producer),
            ),
            Check(
                section="pipeline",
                name=f"{of}transactions discarded",
                expected=0,
                actual=await discarded_transactions(nc, producer),
            ),
        ]
    for topic, group in groups:
        checks.append(
            Check(
                section="pipeline",
                name=f"{group}: messages not handled yet",
                expected=0,
                actual=await unhandled_messages(nc, topic, group),
            )
        )
    for group in dict.fromkeys(group for _, group in groups):
        checks.append(
            Check(
                section="pipeline",
                name=f"{group}: messages dead-lettered",
                expected=0,
                actual=await dead_letters(nc, group),
            )
        )
    return checks
