"""Halves that show up after recovery read TXN_HALF: found, and handed to the partition.

Recovery reads a stream once it is current, but a half can still appear later than that: a
node rebuilt from its raft log serving a read before it caught up, a predecessor's write
that landed after the takeover. A half nobody here knows of is never checked back: its
transaction would stay unsettled (its commit never published) until the next restart. So
the partition keeps reading its TXN_HALF subject past the point recovery reached (headers
only, a look every `FOLLOW_TICKS` ticks), skips the halves it wrote itself, and hands any
other to `found`; the partition then takes it as a recovered half, which the checker asks
about like any other.

The checkpoint never passes what has been looked at (`hold`): a restart in between reads
those halves again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Final

import anyio
import msgspec
from nats.js import JetStreamContext

from txactors.coordinator.core.transactions import Checkpoint
from txactors.coordinator.partition.recovery import read_subject
from txactors.nats.acks import ack_fields
from txactors.nats.retry import LINK_TROUBLE, RETRY_MAX, describe
from txactors.observe.logs import get_logger
from txactors.wire import layout

FOLLOW_TICKS: Final = 10
"""Ticks (`tick_interval`, 0.1 s by default) between two looks at the end of the subject: a
found half waits for its check-back (the transaction timeout) anyway, and a look a second per
partition costs little. Counted in ticks, the partition's clock, so that what stretches the
tick (a test, `bench cpu`) stretches the looks with it."""

Found = Callable[[int, dict[str, str]], Awaitable[None]]
"""Called with the sequence and headers of a half this partition did not write."""

log = get_logger(__name__)


class LateHalves:
    """Follows partition `partition`'s halves after sequence `after` (recovery's end)."""

    def __init__(
        self, js: JetStreamContext, partition: int, after: int, found: Found, *, tick: float
    ) -> None:
        self._js = js
        self._every = FOLLOW_TICKS * tick
        self._subject = layout.half_subject(partition)
        self._partition = partition
        self._next = after + 1
        self._found = found
        self._own: set[int] = set()
        """Sequences this partition wrote and the follower has not reached yet."""

    @property
    def next_seq(self) -> int:
        """The first TXN_HALF sequence not looked at yet."""
        return self._next

    def own(self, seqs: Iterable[int]) -> None:
        """Halves this partition wrote (acknowledged at `seqs`): not late. A sequence
        already passed was seen while its write was in flight, and skipped then."""
        self._own.update(seq for seq in seqs if seq >= self._next)

    def hold(self, checkpoint: Checkpoint) -> Checkpoint:
        """`checkpoint`, not past the first half not looked at yet."""
        if checkpoint.half_seq <= self._next:
            return checkpoint
        return msgspec.structs.replace(checkpoint, half_seq=self._next)

    async def run(self) -> None:
        """Read on forever; a failure JetStream keeps answering is logged and tried again."""
        while True:
            try:
                async for msg in read_subject(
                    self._js,
                    layout.HALF_STREAM,
                    self._subject,
                    self._next,
                    follow=self._every,
                    headers_only=True,
                ):
                    seq = ack_fields(msg).seq
                    self._next = seq + 1
                    if seq in self._own:
                        self._own.discard(seq)
                    else:
                        await self._found(seq, dict(msg.headers or {}))
            except LINK_TROUBLE as error:  # permanent: read_subject retried the transient ones
                problem = describe(error)
                log.error("late_halves_read_failed", partition=self._partition, error=problem)
                await anyio.sleep(RETRY_MAX)
