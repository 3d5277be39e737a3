"""Waiting until a demo's pipeline is empty, before reconciling its books.

Drained means: no transaction is open at the coordinator (every one committed, rolled back
or discarded; a committed one's messages are on their topics before that) and every consumer
group has acked everything on its topic (nothing pending, nothing awaiting an ack or a
retry). Only then do the databases say everything they will ever say.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

import anyio
from nats.aio.client import Client

from txactors import layout
from txactors.admin import list_transactions
from txactors.coordinator.lifecycle import TxnState


async def open_transactions(nc: Client, *, partitions: int = 1) -> int:
    """Transactions not yet in a final state (discarded ones are final for the checker)."""
    pending = await list_transactions(nc, partitions=partitions)
    return sum(info.state != TxnState.DISCARDED for info in pending)


async def unhandled_messages(nc: Client, topic: str, group: str) -> int:
    """Messages of `topic` that consumer group `group` has not acked yet."""
    info = await nc.jetstream().consumer_info(layout.topic_stream(topic), group)
    return int(info.num_pending or 0) + int(info.num_ack_pending or 0)


async def wait_drained(
    nc: Client,
    groups: Sequence[tuple[str, str]],
    *,
    timeout: float,
    also: Callable[[], Awaitable[bool]] | None = None,
    poll: float = 0.1,
    partitions: int = 1,
) -> bool:
    """Wait until drained (see the module docstring) for every `(topic, group)`, and `also()`
    is true; False if that did not happen within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await open_transactions(nc, partitions=partitions) == 0:
            counts = [await unhandled_messages(nc, topic, group) for topic, group in groups]
            if not any(counts) and (also is None or await also()):
                return True
        await anyio.sleep(poll)
    return False
