"""Starting a demo run clean on a NATS server that may hold an earlier run.

A run empties its databases, so everything an earlier run left on the server must go too:
with `TXACTORS_DATA_DIR` (or a shared `NATS_URL`) the topic still holds the earlier run's
messages, which reconciliation would count as committed without a debit. `start_clean`
rolls back what the demo's producer group left open or discarded (its local records are
gone, so rollback is the true answer), then deletes the demo's topics and its groups'
dead-letter streams; deleting a topic deletes its consumer groups' offsets with it.
Other groups' transactions and other topics are not touched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import anyio
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from txactors.ops.txn import Resolution, find_transactions, resolve_all
from txactors.wire import layout
from txactors.wire.protocol import PROTOCOL_VERSION, ListTransactions


async def start_clean(
    nc: Client,
    *,
    producer_group: str,
    topics: Sequence[str],
    consumer_groups: Sequence[str],
    timeout: float = 30.0,
    poll: float = 0.1,
) -> int:
    """Clean up an earlier run (see the module docstring); the number of its transactions
    rolled back. Needs the coordinator running. TimeoutError if some never finish."""
    rolled_back = 0
    with anyio.fail_after(timeout):
        while True:
            left = await find_transactions(
                nc, ListTransactions(group=producer_group, version=PROTOCOL_VERSION)
            )
            if not left.transactions:
                break
            txids = [info.txid for info in left.transactions]
            outcomes = await resolve_all(nc, txids, Resolution.ROLLBACK)
            rolled_back += sum(outcome.error is None for outcome in outcomes)
            if any(outcome.error for outcome in outcomes):
                await anyio.sleep(poll)  # refused while committing: it finishes soon
    js = nc.jetstream()
    streams = [layout.topic_stream(topic) for topic in topics]
    streams += [layout.dlq_stream(group) for group in consumer_groups]
    for stream in streams:
        with contextlib.suppress(NotFoundError):
            await js.delete_stream(stream)
    return rolled_back
