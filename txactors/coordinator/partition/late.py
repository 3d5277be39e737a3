"""Halves that show up after recovery read TXN_LOG_<p>: found, and handed to the partition.

Recovery reads a stream once it is current, but a half can still appear later than that: a
node rebuilt from its raft log serving a read before it caught up, a predecessor's write
that landed after the takeover. A half nobody here knows of is never checked back: its
transaction would stay unsettled (its commit never published) until the next restart. So
the partition keeps reading its half stream past the point recovery reached (headers
only), skips the messages it wrote itself, and hands the halves of any other to `found`; the
partition then takes them as recovered halves, which the checker asks about like any other.
A half stored alone is read from its headers; a pack (many halves in one message) is fetched
whole, which only a message from an earlier owner (or one whose ack is still on its way)
costs.

At the end of its stream a follower reads on only once the stream has grown past it:
`HalfEnd`, one per partition, looks at the stream's last sequence every `FOLLOW_TICKS` ticks
while the stream grows, and half as often each time it did not, down to one look every
`IDLE_LOOK` seconds: an idle partition costs a request every few seconds, not a loop per
tick. It lets a follower read anyway after `IDLE_READ` seconds (its consumer would be dropped
after a minute without one).

The checkpoint never passes what has been looked at (`hold`): a restart in between reads
those halves again, and the op records of their transactions with them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Final

import anyio
import msgspec
import nats.errors
from nats.js import JetStreamContext

from txactors.coordinator.core.transactions import Checkpoint
from txactors.coordinator.partition.halves import StoredHalf, read_half
from txactors.coordinator.partition.packs import is_pack, read_raw_halves
from txactors.coordinator.partition.recovery import UNREADABLE, read_subject
from txactors.nats.acks import ack_fields
from txactors.nats.retry import LINK_TROUBLE, RETRY_MAX, describe, retry_transient
from txactors.observe.logs import get_logger
from txactors.wire import layout

FOLLOW_TICKS: Final = 10
"""Ticks (`tick_interval`, 0.1 s by default) between two looks at the end of a half stream
that grows: a found half waits for its check-back (the transaction timeout) anyway, and a
look a second costs little. Counted in ticks, the partition's clock, so that what stretches
the tick (a test, `bench cpu`) stretches the looks with it."""
IDLE_LOOK: Final = 8.0
"""Seconds between two looks at most, reached while the stream does not grow."""
IDLE_READ: Final = 30.0
"""Seconds a follower waits at most for its stream to grow before it reads anyway: its
consumer (`inactive_threshold` 60 s) must see a pull now and then to live on."""

Found = Callable[[int, list[StoredHalf]], Awaitable[None]]
"""Called with the sequence of a TXN_HALF message this partition did not write and its
halves, in order (a half stored alone has no body here: it stays in TXN_HALF)."""

log = get_logger(__name__)


class HalfEnd:
    """TXN_LOG_<p>'s last sequence, looked at while a follower waits for it: every
    `FOLLOW_TICKS` ticks while it grows, less often while it does not (down to `IDLE_LOOK`)."""

    def __init__(self, js: JetStreamContext, partition: int, *, tick: float) -> None:
        self._js = js
        self._stream = layout.half_stream(partition)
        self._often = FOLLOW_TICKS * tick
        self._every = self._often
        self._last = 0
        self._look: anyio.Event | None = None
        """Set when the look under way (None: none) is done."""
        self._looked = True
        """Whether the last look could tell the stream's last sequence."""

    @property
    def last(self) -> int:
        """The stream's last sequence as last looked at (0: not yet)."""
        return self._last

    async def grown(self, past: int) -> None:
        """Return once the stream's last sequence is beyond `past` (or it cannot be
        looked at: the caller reads and sees why), or after `IDLE_READ` seconds."""
        with anyio.move_on_after(IDLE_READ):
            while self._last <= past:
                look = self._look
                if look is None:
                    await self._look_now()
                else:
                    await look.wait()
                if not self._looked:
                    return

    async def _look_now(self) -> None:
        """Look, for everyone waiting; one cancelled meanwhile leaves the next to a waiter."""
        self._look = anyio.Event()
        try:
            await anyio.sleep(self._every)
            try:
                info = await self._js.stream_info(self._stream)
            except LINK_TROUBLE as error:
                log.info("half_end_not_read", stream=self._stream, error=describe(error))
                self._looked = False
            else:
                grown = info.state.last_seq != self._last
                self._every = self._often if grown else min(self._every * 2, IDLE_LOOK)
                self._last, self._looked = info.state.last_seq, True
        finally:
            look, self._look = self._look, None
            look.set()


class LateHalves:
    """Follows partition `partition`'s halves after sequence `after` (recovery's end)."""

    def __init__(
        self, js: JetStreamContext, partition: int, after: int, found: Found, *, end: HalfEnd
    ) -> None:
        self._js = js
        self._end = end
        self._read_to = after
        """What the stream's end was when the follower last read to its end."""
        self._subject = layout.half_subject(partition)
        self._stream = layout.half_stream(partition)
        self._partition = partition
        self._next = after + 1
        self._found = found
        self._own: dict[int, int] = {}
        """Sequences of messages this partition wrote that the follower has not reached yet,
        each with the first TXN_OP sequence a record of its transactions can have."""

    @property
    def next_seq(self) -> int:
        """The first TXN_LOG_<p> sequence not looked at yet."""
        return self._next

    def own(self, seqs: Iterable[int], op_floor: int) -> None:
        """Messages this partition wrote (acknowledged at `seqs`): not late. A sequence
        already passed was seen while its write was in flight, and its halves skipped then.
        `op_floor`: the first TXN_OP sequence a record of their transactions can have (the
        table's, `op_floor`, as it takes them in)."""
        self._own.update((seq, op_floor) for seq in seqs if seq >= self._next)

    def hold(self, checkpoint: Checkpoint) -> Checkpoint:
        """`checkpoint`, not past the first half not looked at yet.

        Held back, it goes back in TXN_OP too, to the first record of the transactions whose
        halves it reads again: they may have finished since (their records lie before the
        table's op offset), and read without their records they would come back as open
        ones (checked back, published again, even discarded)."""
        if checkpoint.half_seq <= self._next:
            return checkpoint
        op_seq = min([checkpoint.op_seq, *self._own.values()])
        return msgspec.structs.replace(checkpoint, half_seq=self._next, op_seq=op_seq)

    async def _follow(self) -> None:
        """Wait until the stream has grown since the last read (one that reached the end of
        the subject saw every half stored before it started)."""
        await self._end.grown(self._read_to)
        self._read_to = self._end.last

    async def run(self) -> None:
        """Read on forever; a failure JetStream keeps answering is logged and tried again."""
        while True:
            try:
                async for msg in read_subject(
                    self._js,
                    self._stream,
                    self._subject,
                    self._next,
                    follow=self._follow,
                    headers_only=True,
                ):
                    seq = ack_fields(msg).seq
                    if seq in self._own:
                        del self._own[seq]
                        self._next = seq + 1
                        continue
                    halves = await self._halves(seq, msg.headers or {})
                    self._next = seq + 1  # not before: the checkpoint must not pass them
                    if seq in self._own:  # our own pack, whose ack came while it was read
                        del self._own[seq]
                    elif halves:
                        await self._found(seq, halves)
            except LINK_TROUBLE as error:  # permanent: read_subject retried the transient ones
                problem = describe(error)
                log.error("late_halves_read_failed", partition=self._partition, error=problem)
                await anyio.sleep(RETRY_MAX)

    async def _halves(self, seq: int, headers: Mapping[str, str]) -> list[StoredHalf]:
        """The halves of the message at `seq`: a half stored alone from its headers, a pack
        fetched whole. Empty if it cannot be read (logged, and skipped)."""
        try:
            if not is_pack(headers):
                return [read_half(seq, headers, b"")]
            raw = await retry_transient(self._js.get_msg, self._stream, seq)
            return read_raw_halves(raw)
        except (*UNREADABLE, nats.errors.Error) as error:
            problem = repr(error)
            log.warning("late_half_unreadable", partition=self._partition, seq=seq, error=problem)
            return []
