"""The process's writers: one set per partition for its own log, one per topic and the
discards for everyone.

Each partition's log stands alone (`partition/streams.py`), so its writers do too
(`PartitionWriters`): its halves' `PipelinedWriter` and its `OpWriter`, both to TXN_LOG_<p>,
and its follower's look at the log's end. A stream electing a leader then holds
up only its own partition: a writer shared by several streams gives up every pending ack on
a fault and settles its jobs in order, so one stream's outage would stall the others' writes.
A partition's writers are made when it is first taken and live as long as the process, so a
write in flight outlives the instance that made it (a successor waits for it, `ops_idle`).

Each topic stream has one writer for the process, the discards one: a topic's or
TXN_DISCARD's trouble is shared by design, every partition writing to it sees it. With
`sync_interval: always` the server flushes once per write, so the number of writes sets the
pace: those shared writers carry whatever every partition queued for them meanwhile.

A partition reaches a writer through a `PartitionWriter` (`nats/writer.py`): its own
quarantine, and a report that fails only its own instance (the supervisor restarts it)
while the writer goes on serving the others. A partition that stops leaves what it
submitted to be written (halves, committed publishes and discard copies are all safe to
store late: each has its dedupe id, and its completion is dropped by the ended instance, see
`partition/actor.py`). Submit order is stream order.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
from anyio.abc import TaskGroup
from nats.aio.client import Client
from nats.js import JetStreamContext

from txactors.coordinator.options import CoordinatorOptions
from txactors.coordinator.partition.late import HalfEnd
from txactors.coordinator.partition.oplog import OpWriter
from txactors.errors import ConfigError
from txactors.nats.link import linked
from txactors.nats.retry import LINK_TROUBLE, LinkLost, describe
from txactors.nats.topics import ensure_topic_stream
from txactors.nats.writer import Append, PipelinedWriter
from txactors.observe.logs import get_logger

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class PartitionWriters:
    """One partition's writers to its own streams (see the module docstring)."""

    halves: PipelinedWriter
    ops: OpWriter
    half_end: HalfEnd
    """Where the partition's late-halves follower waits for TXN_LOG_<p> to grow."""


class SharedWriters:
    """The process's writers: `discards`, one per topic (made on first use), and each
    partition's own (`of`, made when it is first taken)."""

    def __init__(
        self, nc: Client, js: JetStreamContext, options: CoordinatorOptions, tasks: TaskGroup
    ) -> None:
        self._nc = nc
        self._js = js
        self._options = options
        self._tasks = tasks
        self._topics: dict[str, PipelinedWriter] = {}
        self._partitions: dict[int, PartitionWriters] = {}
        self.discards = self._new()

    def of(self, partition: int) -> PartitionWriters:
        """`partition`'s writers, made and started on first use."""
        writers = self._partitions.get(partition)
        if writers is None:
            ops = OpWriter(self._nc, self._js)
            self._tasks.start_soon(ops.run)
            end = HalfEnd(self._js, partition, tick=self._options.tick_interval)
            writers = self._partitions[partition] = PartitionWriters(self._new(), ops, end)
        return writers

    async def ops_idle(self, partition: int) -> None:
        """Until no op write of `partition` (a previous instance's) is in flight."""
        writers = self._partitions.get(partition)
        if writers is not None:
            await writers.ops.idle(partition)

    def topic(self, topic: str) -> PipelinedWriter:
        """The writer of `topic`'s stream: a topic whose stream is unavailable holds up only
        the commits with a message in it (see `partition/publisher.py`)."""
        writer = self._topics.get(topic)
        if writer is None:
            writer = self._topics[topic] = self._new(functools.partial(self._redeclare, topic))
        return writer

    async def _redeclare(self, topic: str, _: Append) -> None:
        """A topic stream is gone while committed messages wait for it: declare it again."""
        try:
            await linked(self._nc, declare_topic, self._js, self._options, topic)
        except (ConfigError, LinkLost, *LINK_TROUBLE) as error:
            log.warning("topic_stream_not_redeclared", topic=topic, error=describe(error))
        else:
            log.warning("topic_stream_redeclared", topic=topic)

    def _new(self, redeclare: Callable[[Append], Awaitable[None]] | None = None) -> PipelinedWriter:
        linger = self._options.write_linger
        writer = PipelinedWriter(self._nc, self._js, linger=linger, redeclare=redeclare)
        self._tasks.start_soon(writer.run)
        return writer


async def declare_topic(js: JetStreamContext, options: CoordinatorOptions, topic: str) -> None:
    """Make sure `topic` has its stream, trying once: callers answer or retry a transient
    failure themselves."""
    await ensure_topic_stream(
        js,
        topic,
        duplicate_window=options.topic_duplicate_window,
        replicas=options.replicas,
        deadline=0.0,
    )


@asynccontextmanager
async def shared_writers(
    nc: Client, js: JetStreamContext, options: CoordinatorOptions
) -> AsyncIterator[SharedWriters]:
    """The process's writers, running until the block exits (after its partitions stopped)."""
    async with anyio.create_task_group() as tasks:
        yield SharedWriters(nc, js, options, tasks)
        tasks.cancel_scope.cancel()
