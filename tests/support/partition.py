"""One stand-in for the partition actor, for tests of what talks to a partition.

It keeps everything it is told (`Recorder.heard`: a checker's `Due`, say) and answers
prepares and ends as the protocol says a partition does (a token per transaction, one
sequence number per message, a decision kept once made), with knobs to make it refuse.
Served on the bus by `serving_partitions`, it stands in for the coordinator of a
producer's tests; spawned alone, it is the owner a checker reports to. It answers the batch
verbs item by item as a coordinator does (each item exactly as it would be answered alone),
or, told to, as an older coordinator: batches refused `unknown_command` (`batches=False`), or
version 3 refused `unsupported_version` (`speaks=2`).
"""

from __future__ import annotations

import functools
import itertools
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from nats.aio.client import Client

from txactors.actors import Actor, ActorSystem, serve
from txactors.coordinator.cluster.agreement import agree_partition_count, meta_bucket
from txactors.wire.layout import end_filter, prepare_filter
from txactors.wire.protocol import (
    PROTOCOL_VERSION,
    Command,
    CoordinatorCommand,
    Decision,
    EndBatch,
    Ended,
    EndedBatch,
    EndTransaction,
    Error,
    ErrorCode,
    Prepare,
    PrepareBatch,
    Prepared,
    PreparedBatch,
)

STATE_AFTER = {
    Decision.COMMIT: "committed",
    Decision.ROLLBACK: "rolled_back",
    Decision.UNKNOWN: "prepared",
}


@dataclass
class Recorder:
    """What the stand-in partitions received, and knobs to make them refuse."""

    refuse_prepare: Callable[[Prepare], Error | None] = lambda _: None
    refuse_end: Error | None = None
    batches: bool = True
    """False: batches are refused `unknown_command`, as by a coordinator without them."""
    speaks: int = PROTOCOL_VERSION
    """The newest version answered; a newer one is refused `unsupported_version`."""
    max_batch_items: int = 256
    """A batch with more items is refused whole (`bad_request`), as by the coordinator."""
    gate: anyio.Event | None = None
    """When set, every command waits for it before it is answered (requests pile up)."""
    requests: list[tuple[str, int]] = field(default_factory=list)
    """Every command received: its type and how many transactions it carried."""
    prepares: list[tuple[int, Prepare]] = field(default_factory=list)
    ends: list[EndTransaction] = field(default_factory=list)
    heard: list[Any] = field(default_factory=list)
    tokens: dict[str, str] = field(default_factory=dict)
    decided: dict[str, Decision] = field(default_factory=dict)
    seqs: itertools.count[int] = field(default_factory=lambda: itertools.count(1))


class FakePartition(Actor):
    """Answers prepares and ends from `recorder`; keeps any other message in `heard`."""

    def __init__(self, recorder: Recorder, partition: int = 0) -> None:
        self.recorder = recorder
        self.partition = partition

    async def receive(self, message: Any) -> Any:
        r = self.recorder
        if not isinstance(message, Command):
            r.heard.append(message)
            return None
        batch = isinstance(message, PrepareBatch | EndBatch)
        r.requests.append((type(message).__name__, len(message.items) if batch else 1))
        if r.gate is not None:
            await r.gate.wait()
        if message.version > r.speaks:
            return Error(ErrorCode.UNSUPPORTED_VERSION, f"version {message.version} is too new")
        if batch and not r.batches:
            return Error(ErrorCode.UNKNOWN_COMMAND, f"unknown command {type(message).__name__!r}")
        if batch and len(message.items) > r.max_batch_items:
            return Error(ErrorCode.BAD_REQUEST, f"$.items: 1 to {r.max_batch_items} items")
        match message:
            case Prepare():
                return self._prepare(message)
            case EndTransaction():
                return self._end(message)
            case PrepareBatch():
                return PreparedBatch(
                    results=[
                        self._prepare(
                            Prepare(
                                txid=item.txid,
                                group=message.group,
                                producer=message.producer,
                                messages=item.messages,
                                token=item.token,
                                version=message.version,
                            )
                        )
                        for item in message.items
                    ]
                )
            case EndBatch():
                return EndedBatch(
                    results=[
                        self._end(
                            EndTransaction(
                                txid=item.txid,
                                token=item.token,
                                decision=item.decision,
                                version=message.version,
                            )
                        )
                        for item in message.items
                    ]
                )
        r.heard.append(message)
        return None

    def _prepare(self, message: Prepare) -> Prepared | Error:
        r = self.recorder
        r.prepares.append((self.partition, message))
        if (refusal := r.refuse_prepare(message)) is not None:
            return refusal
        if r.tokens.get(message.txid) != message.token and message.token is not None:
            return Error(ErrorCode.FORBIDDEN, "wrong token")
        token = r.tokens.setdefault(message.txid, uuid.uuid4().hex)
        seqs = [next(r.seqs) for _ in message.messages]
        return Prepared(txid=message.txid, token=token, seqs=seqs)

    def _end(self, message: EndTransaction) -> Ended | Error:
        r = self.recorder
        r.ends.append(message)
        if r.refuse_end is not None:
            return r.refuse_end
        if r.tokens.get(message.txid) != message.token:
            return Error(ErrorCode.FORBIDDEN, "wrong token")
        if message.decision is not Decision.UNKNOWN:
            earlier = r.decided.setdefault(message.txid, message.decision)
            if earlier is not message.decision:
                return Error(ErrorCode.CONFLICT, f"already {earlier}")
        return Ended(txid=message.txid, state=STATE_AFTER[message.decision])


@asynccontextmanager
async def serving_partitions(
    nc: Client, *, partitions: int = 1, serve_end: bool = True, **knobs: Any
) -> AsyncIterator[Recorder]:
    """`partitions` fakes on every group's prepare (and end) subjects, the count agreed."""
    recorder = Recorder(**knobs)
    await agree_partition_count(await meta_bucket(nc.jetstream(), replicas=1), partitions)
    async with ActorSystem("stand-in") as system:
        subscriptions = []
        for p in range(partitions):
            factory = functools.partial(FakePartition, recorder, p)
            ref = await system.spawn(factory, name=f"coordinator-{p}")
            subjects = [prepare_filter(p)] + ([end_filter(p)] if serve_end else [])
            for subject in subjects:
                subscriptions.append(await serve(nc, ref, subject, CoordinatorCommand))
        try:
            yield recorder
        finally:
            for subscription in subscriptions:
                await subscription.unsubscribe()
