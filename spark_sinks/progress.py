"""What a sink run reports, and the watch that reads it off the running queries.

The events (`BatchStarted`, `BatchRunning`, `BatchProgress`, `CaughtUp`, `Skipped`) go to the
run's `on_progress` callback; `spark_sinks.cli` prints them. `ProgressWatch` derives them from
each query's checkpoint (a batch planned) and its `recentProgress` (a batch finished), as the
run polls. What a batch skips with failOnDataLoss off the source says itself, once, as it plans
the batch (source.py); `Skipped` is what the plan settled before any query ran.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from spark_sinks.checkpoint import position
from spark_sinks.offsets import StreamPosition, first_to_read
from txactors.wire.layout import topic_stream

if TYPE_CHECKING:
    from pyspark.sql.streaming.query import StreamingQuery

    from spark_sinks.planning import Plan

STILL_RUNNING_EVERY: Final = 15.0
"""Seconds between "still reading" lines while one batch runs."""


@dataclass(frozen=True, slots=True)
class BatchStarted:
    """A micro-batch was planned: it reads sequences [first, last] of the topic's stream."""

    topic: str
    batch_id: int
    first: int
    last: int


@dataclass(frozen=True, slots=True)
class BatchRunning:
    """A batch still runs after `seconds` (sent every STILL_RUNNING_EVERY seconds)."""

    topic: str
    batch_id: int
    seconds: float


@dataclass(frozen=True, slots=True)
class BatchProgress:
    """One finished micro-batch of one topic."""

    topic: str
    batch_id: int
    rows: int
    end_seq: int
    head_seq: int | None
    seconds: float

    @property
    def lag(self) -> int | None:
        """Messages the stream holds beyond this batch (None if the source did not say)."""
        return None if self.head_seq is None else max(self.head_seq - self.end_seq, 0)


@dataclass(frozen=True, slots=True)
class CaughtUp:
    """Every topic has read its stream to `seqs` (topic → last sequence read)."""

    seqs: dict[str, int]
    waiting: bool  # a continuous run waits for more; a catch-up run is done


@dataclass(frozen=True, slots=True)
class Skipped:
    """A query that never ran starts on a stream created again since its start was pinned
    (failOnDataLoss is off): said by the plan, since its source never sees the old stream."""

    message: str


Progress = BatchStarted | BatchRunning | BatchProgress | CaughtUp | Skipped
ProgressCallback = Callable[[Progress], None]


class ProgressWatch:
    """Turns the queries' checkpoints and progress into Progress events, as the run polls."""

    def __init__(
        self,
        planned: Plan,
        queries: Mapping[str, StreamingQuery],
        emit: ProgressCallback,
        *,
        waiting: bool,
    ) -> None:
        self.plans = {t.topic: t for t in planned.topics}
        self.queries = queries
        self.emit = emit
        self.waiting = waiting
        self.rows = 0
        self.read = {t.topic: t.read_up_to for t in planned.topics}
        self.heads = {t.topic: t.bounds.last for t in planned.topics}
        committed = {t.topic: t.position.committed_batch for t in planned.topics}
        self.finished = {t: -1 if b is None else b for t, b in committed.items()}
        self.announced = dict(self.finished)  # the last batch a BatchStarted was sent for
        self.running: dict[str, tuple[int, float, float]] = {}  # batch, since, last said
        self.idle_said = False

    def seqs(self) -> dict[str, int]:
        return dict(self.read)

    def poll(self) -> None:
        now = time.monotonic()
        for topic, query in self.queries.items():
            self._finished_batches(topic, query)
            self._running_batch(topic, now)
        if self.waiting and not self.running and not self.idle_said and self._all_caught_up():
            self.idle_said = True
            self.emit(CaughtUp(self.seqs(), waiting=True))

    def _running_batch(self, topic: str, now: float) -> None:
        checkpoint = self.plans[topic].checkpoint
        where = position(checkpoint)
        batch = where.planned_batch
        if batch is None or batch <= self.finished[topic] or where.planned is None:
            self.running.pop(topic, None)
            return
        if topic not in self.running or self.running[topic][0] != batch:
            stream = topic_stream(topic)
            read = (where.committed or {}).get(stream, StreamPosition(self.read[topic]))
            end = where.planned.get(stream, read)
            self.running[topic] = (batch, now, now)
            self.idle_said = False
            self._announce(topic, batch, first_to_read(read, end), end.seq)
            return
        _, since, said = self.running[topic]
        if now - said >= STILL_RUNNING_EVERY:
            self.running[topic] = (batch, since, now)
            self.emit(BatchRunning(topic, batch, now - since))

    def _finished_batches(self, topic: str, query: StreamingQuery) -> None:
        stream = topic_stream(topic)
        for progress in query.recentProgress:
            batch_id = int(progress["batchId"])
            source = (progress.get("sources") or [{}])[0]
            head = _position(source.get("latestOffset"), stream)
            if head is not None:
                self.heads[topic] = head.seq
            # An idle trigger reports a progress with no rows under the next batch's id; only
            # batches that moved rows are reported (and the real batch keeps its id).
            end = _position(source.get("endOffset"), stream)
            start = _position(source.get("startOffset"), stream)
            read_before = self.read[topic]
            if end is not None:  # the end of the latest batch: a new stream starts lower
                self.read[topic] = end.seq
            rows = int(progress["numInputRows"])
            if batch_id <= self.finished[topic] or not rows:
                continue
            self.finished[topic] = batch_id
            self.running.pop(topic, None)
            if end is not None:  # it ran between two polls: say it started
                read = start if start is not None else StreamPosition(read_before)
                self._announce(topic, batch_id, first_to_read(read, end), end.seq)
            self.idle_said = False
            self.rows += rows
            self.emit(
                BatchProgress(
                    topic=topic,
                    batch_id=batch_id,
                    rows=rows,
                    end_seq=0 if end is None else end.seq,
                    head_seq=None if head is None else head.seq,
                    seconds=int(progress.get("batchDuration", 0)) / 1000,
                )
            )

    def _announce(self, topic: str, batch: int, first: int, last: int) -> None:
        """BatchStarted, once per batch: the checkpoint or the progress, whichever shows it
        first (a batch can be committed before its progress is posted)."""
        if batch > self.announced[topic] and last >= first:
            self.announced[topic] = batch
            self.emit(BatchStarted(topic, batch, first, last))

    def _all_caught_up(self) -> bool:
        return all(self.read[t] >= self.heads[t] for t in self.queries)


def _position(offset: Any, stream: str) -> StreamPosition | None:
    if isinstance(offset, str):
        offset = json.loads(offset)
    if isinstance(offset, dict) and stream in offset:
        return StreamPosition.decode(offset[stream])
    return None
