"""Carrying out `Publish`: a committed half, copied to its topic stream with its dedupe id.

Topic streams are declared when a prepare first names the topic (`declare`), so that a
commit never waits for one. A topic allowed only by prefix rules of the tenant policy gets a
new stream only while one of those rules has fewer than `max_prefix_topics` (tenants.py).

The partition keeps the messages of its open transactions (from their prepare, or read
back during recovery), so a publish costs one topic write and no read; a body it no longer
has (after a restart the checkpoint skipped, or a purge) is read back from TXN_HALF by
sequence: the step's actions that name one TXN_HALF message (a pack holds the halves of many
transactions, all at its sequence) share one read, whose body is dropped once their halves are
submitted. The `Publish` actions of one step go out as one job per topic stream, and each
job's completion comes back as one list of `Published` events, which the partition feeds to
its table as one step.

Each topic stream has a `PipelinedWriter` of its own, shared by the process's partitions
(`coordinator/writers.py`, reached through a `PartitionWriter`): a topic whose stream is unavailable
(its leader being elected, its server down, the stream deleted) holds up only the commits
that have a message in it, while every other topic's commits go through. This is safe
because the decision is durable in TXN_OP before any publish: a transaction's topics may be
written in any order, and its `done` record waits until all of them are (the table's rule).
The unavailable topic's writer retries with backoff (declaring a deleted stream again) and
catches up, in order and with the same dedupe ids, once the stream is back.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from txactors.coordinator.core.effects import Publish
from txactors.coordinator.core.events import Published
from txactors.coordinator.core.states import FINAL
from txactors.coordinator.core.table import TransactionTable
from txactors.coordinator.options import Clock, CoordinatorOptions
from txactors.coordinator.partition.halves import StoredHalf, half_in, seconds_text
from txactors.coordinator.partition.packs import read_raw_halves
from txactors.coordinator.writers import declare_topic
from txactors.errors import ConfigError
from txactors.nats.link import linked
from txactors.nats.retry import (
    LINK_TROUBLE,
    RETRY_MAX,
    LinkLost,
    describe,
    retry_transient,
    transient,
)
from txactors.nats.topics import topic_stream_count
from txactors.nats.writer import Append, PartitionWriter, Quarantine
from txactors.observe import tracing
from txactors.observe.logs import get_logger
from txactors.wire import layout
from txactors.wire.protocol import ErrorCode, OutgoingMessage

log = get_logger(__name__)

OnPublished = Callable[[list[Published]], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class NotDeclared:
    """Why a topic's stream cannot be declared now; `retry_after` set when it may pass."""

    reason: str
    retry_after: float | None
    code: ErrorCode = ErrorCode.INTERNAL
    """`forbidden` when a prefix rule's cap refuses a new stream (no retry helps)."""


@dataclass(slots=True)
class _Kept:
    """The messages of an open transaction, kept for publishing and trace context."""

    group: str
    messages: dict[int, OutgoingMessage] = field(default_factory=dict)


class Publisher:
    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        writer_of: Callable[[str], PartitionWriter],
        partition: int,
        options: CoordinatorOptions,
        clock: Clock,
        quarantine: Quarantine,
        on_published: OnPublished,
    ) -> None:
        self._nc = nc
        self._js = js
        self._options = options
        self._topics: set[str] = set()
        """Topics whose stream is known to exist."""
        self._writer_of = writer_of
        self._writers: dict[str, PartitionWriter] = {}
        """Into the writer of each topic (so of each topic stream) a publish named."""
        self._partition = partition
        self._clock = clock
        self._quarantine = quarantine
        self._on_published = on_published
        self._kept: dict[str, _Kept] = {}
        self._tracer = tracing.RecentTracer()
        """Of the publish spans: looked up at most once a second, not per commit."""

    def declared(self, topics: set[str]) -> bool:
        """Every topic's stream is known to exist (`declare` would not wait)."""
        return topics <= self._topics

    async def declare(
        self, topics: set[str], rules: Mapping[str, tuple[str, ...]]
    ) -> NotDeclared | None:
        """Make sure each topic has its stream; why not, if JetStream cannot say so now or
        the prefix rules in `rules[topic]` (none: not capped) are all at their cap.

        Tried once: the prepare waiting for it holds the partition's mailbox, so a transient
        failure is answered with a retry-after hint instead of being waited out here.
        """
        for topic in topics - self._topics:
            try:
                capped = await linked(self._nc, self._capped, topic, rules.get(topic, ()))
                if capped is not None:
                    return capped
                await linked(self._nc, declare_topic, self._js, self._options, topic)
            except (ConfigError, LinkLost, *LINK_TROUBLE) as error:
                log.warning("topic_stream_not_declared", topic=topic, error=describe(error))
                reason = f"the stream of topic {topic} cannot be declared now: {describe(error)}"
                return NotDeclared(reason, RETRY_MAX if transient(error) else None)
            self._topics.add(topic)
        return None

    async def _capped(self, topic: str, rules: tuple[str, ...]) -> NotDeclared | None:
        """Refusal when `topic` needs a new stream and every rule allowing it is at its cap.
        Checked before the create, so partitions creating at the same moment may together
        pass a cap by at most one stream each."""
        if not rules:
            return None
        try:
            await self._js.stream_info(layout.topic_stream(topic))
            return None  # exists: nothing new is made
        except NotFoundError:
            pass
        cap = self._options.max_prefix_topics
        for rule in rules:
            if await topic_stream_count(self._nc, rule[:-1]) < cap:
                return None
        log.warning("topic_stream_cap_reached", topic=topic, rules=rules, cap=cap)
        reason = (
            f"topic {topic} would be a new stream, but the group_topics rule "
            f"{' and '.join(rules)} already has {cap} topic streams (max_prefix_topics)"
        )
        return NotDeclared(reason, None, ErrorCode.FORBIDDEN)

    def _writer(self, topic: str) -> PartitionWriter:
        writer = self._writers.get(topic)
        if writer is None:
            writer = self._writers[topic] = self._writer_of(topic)
        return writer

    def keep(self, stored: StoredHalf) -> None:
        """Remember a stored half's message until its transaction is finished."""
        kept = self._kept.setdefault(stored.txid, _Kept(stored.group))
        kept.messages[stored.half.index] = stored.message

    def forget_finished(self, table: TransactionTable) -> None:
        """Drop what finished transactions left (rolled back, answered by a check, unknown
        to the table): O(kept), done at checkpoint time, not per message."""
        for txid in [t for t in self._kept if table.outcome(t) in (None, *FINAL)]:
            del self._kept[txid]

    def trace_context(self, txid: str) -> dict[str, str]:
        """The properties of a kept half of `txid`, where its trace context travels."""
        kept = self._kept.get(txid)
        half = next(iter(kept.messages.values()), None) if kept is not None else None
        return half.properties if half is not None else {}

    def publish(self, actions: list[Publish]) -> list[list[Publish]]:
        """Submit the publishes whose bodies are kept, as one job per topic stream; return
        the others grouped by the TXN_HALF message that holds their halves (each group to be
        read back with one `publish_from_stream`). Never waits."""
        jobs: dict[str, tuple[list[Append], list[Published]]] = {}  # by topic
        unkept: dict[int, list[Publish]] = {}  # by TXN_HALF sequence
        for action in actions:
            kept = self._kept.get(action.txid)
            message = kept.messages.pop(action.index, None) if kept is not None else None
            if message is None or kept is None:
                unkept.setdefault(action.half_seq, []).append(action)
                continue
            if not kept.messages:
                del self._kept[action.txid]
            self._job(jobs, action, kept.group, message)
        self._submit(jobs)
        return list(unkept.values())

    def _job(
        self,
        jobs: dict[str, tuple[list[Append], list[Published]]],
        action: Publish,
        group: str,
        message: OutgoingMessage,
    ) -> None:
        appends, done = jobs.setdefault(message.topic, ([], []))
        appends.append(self._topic_append(action, group, message))
        done.append(Published(txid=action.txid, index=action.index))

    def _submit(self, jobs: dict[str, tuple[list[Append], list[Published]]]) -> None:
        for topic, (appends, done) in jobs.items():
            self._writer(topic).submit(appends, functools.partial(self._reported, done))

    async def _reported(self, done: list[Published], _: object) -> None:
        await self._on_published(done)

    async def publish_from_stream(self, actions: list[Publish]) -> None:
        """After a restart the bodies are only in TXN_HALF: read back the message at the
        sequence all of `actions` name, once, and publish each one's half from it."""
        seq = actions[0].half_seq
        try:
            raw = await retry_transient(self._js.get_msg, layout.half_stream(self._partition), seq)
            halves = read_raw_halves(raw)
        except Exception as error:  # gone (purged by hand?) or unreadable: never publishable
            for action in actions:
                await self._unreadable(action, error)
            return
        jobs: dict[str, tuple[list[Append], list[Published]]] = {}
        unreadable: list[tuple[Publish, KeyError]] = []
        for action in actions:
            try:
                stored = half_in(halves, action.txid, action.index)
            except KeyError as missing:  # the message there is not the one recorded
                unreadable.append((action, missing))
                continue
            self._job(jobs, action, stored.group, stored.message)
        del raw, halves  # only the appends' bodies stay, until written
        self._submit(jobs)
        for action, absent in unreadable:
            await self._unreadable(action, absent)

    async def _unreadable(self, action: Publish, error: Exception) -> None:
        """Quarantine a committed half that cannot be read back and report it published: no
        retry would make it publishable."""
        subject = layout.half_subject(self._partition)
        reason = (
            f"committed half {action.index} of {action.txid} (TXN_HALF seq {action.half_seq}) "
            f"cannot be read: {describe(error)}"
        )
        await self._quarantine(Append(subject, b"", {}), reason)
        await self._on_published([Published(txid=action.txid, index=action.index)])

    def _topic_append(self, action: Publish, group: str, message: OutgoingMessage) -> Append:
        headers = dict(message.properties)
        headers[layout.MSG_ID_HEADER] = action.msg_id
        headers[layout.TXID_HEADER] = action.txid
        headers[layout.GROUP_HEADER] = group
        headers[layout.INDEX_HEADER] = str(action.index)
        headers[layout.COMMITTED_AT_HEADER] = seconds_text(self._clock())
        if message.tag is not None:
            headers[layout.TAG_HEADER] = message.tag
        if message.keys:
            headers[layout.KEYS_HEADER] = ",".join(message.keys)
        found = self._tracer()
        tracing.record_publish(found, headers, action.txid, action.msg_id, message.topic)
        subject = layout.topic_subject(message.topic, message.tag)
        return Append(subject, message.body, headers, layout.topic_stream(message.topic))
