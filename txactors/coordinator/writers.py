"""One writer per stream per coordinator process, shared by every partition it serves.

With `sync_interval: always` the server flushes once per write, so the number of writes sets
the pace: eight partitions each with writers of their own would make eight times as many
smaller writes for the same load. Here the halves of every partition go to TXN_HALF through
one `PipelinedWriter` (the subjects differ, the stream is one, so they share atomic
batches), the discards through one, and each topic stream has one writer for the process.
Submit order is still stream order, for each partition as for all.

A partition reaches a shared writer through a `PartitionWriter` (`nats/writer.py`): its own
quarantine, and a report that fails only its own instance (the supervisor restarts it)
while the writer goes on serving the others. A partition that stops leaves what it
submitted to be written (halves, committed publishes and discard copies are all safe to
store late: each has its dedupe id, and its completion is dropped by the ended instance, see
`partition/actor.py`). A stream's trouble is shared by design: every partition writing to it
sees it. TXN_OP's writer (`ops`, `partition/oplog.py`) is shared the same way, each
partition's messages in its batches fenced on their own. The partitions' followers of late
halves share one look at TXN_HALF's end (`half_end`, `partition/late.py`).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

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


class SharedWriters:
    """The process's writers: `halves`, `discards`, `ops`, and one per topic (made on first
    use); and `half_end`, where the partitions' late-halves followers wait for TXN_HALF to
    grow."""

    def __init__(
        self, nc: Client, js: JetStreamContext, options: CoordinatorOptions, tasks: TaskGroup
    ) -> None:
        self._nc = nc
        self._js = js
        self._options = options
        self._tasks = tasks
        self._topics: dict[str, PipelinedWriter] = {}
        self.halves = self._new()
        self.discards = self._new()
        self.ops = OpWriter(nc, js)
        self.half_end = HalfEnd(js, tick=options.tick_interval)
        tasks.start_soon(self.ops.run)

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
