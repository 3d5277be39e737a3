"""The source's offsets: where a query starts (`startingOffsets`), what it lost (failOnDataLoss).

An offset is, per stream, the last sequence already read: `{"TOPIC_transfers": 1200}` means
batches so far hold sequences up to 1200. Users name a start the way Kafka's source does, by
the first position to read, per topic:

    earliest                      the stream's first sequence still held (the default)
    latest                        only messages committed after the query first starts
    {"transfers": 1201, "b": -2}  sequence 1201 of `transfers`; -2 earliest, -1 latest

A JSON start names every topic of the query, as Kafka asks of partitions, so a typo fails.
It applies only when a query starts without a checkpoint; a rerun resumes from its checkpoint.

Data loss is what Kafka calls an offset out of range: retention purged sequences (the stream's
first sequence moved past `offset + 1`) before the query read them; or the stream was deleted
and created again (a demo's rerun does), so its sequences restart at 1 and the offset names a
stream that is gone. Each entry of an offset keeps the stream's creation time for that
(StreamPosition). Pure logic; the source and the job bring the stream bounds.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from spark_sinks.errors import SinkError, StreamMissing
from spark_sinks.jetstream_read import Bounds
from txactors.wire.layout import topic_stream

EARLIEST: Final = "earliest"
LATEST: Final = "latest"
_EARLIEST_SEQ: Final = -2
_LATEST_SEQ: Final = -1

Starting = str | dict[str, int]
"""`earliest`, `latest`, or {topic: first sequence to read, -2 earliest, -1 latest}."""


def parse_starting(raw: str | None, topics: Sequence[str]) -> Starting:
    """`startingOffsets` as given (option or CLI flag) → a checked Starting."""
    text = (raw or EARLIEST).strip()
    if text.lower() in (EARLIEST, LATEST):
        return text.lower()
    try:
        given = json.loads(text)
    except json.JSONDecodeError:
        given = None
    if not isinstance(given, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in given.values()
    ):
        raise SinkError(
            f"startingOffsets {text!r}: expected earliest, latest or JSON like "
            '{"transfers": 1201} (the first sequence to read per topic; -2 earliest, -1 latest)'
        )
    unknown = sorted(set(given) - set(topics))
    missing = [t for t in topics if t not in given]
    if unknown or missing:
        raise SinkError(
            f"startingOffsets must name exactly the topics read ({', '.join(topics)}); "
            + "; ".join(
                part
                for part in (
                    f"unknown: {', '.join(unknown)}" if unknown else "",
                    f"missing: {', '.join(missing)}" if missing else "",
                )
                if part
            )
        )
    bad = [f"{t}={v}" for t, v in given.items() if v < 1 and v not in (_EARLIEST_SEQ, _LATEST_SEQ)]
    if bad:
        raise SinkError(
            f"startingOffsets {', '.join(bad)}: a sequence is 1 or more (-2 earliest, -1 latest)"
        )
    return {t: int(given[t]) for t in topics}


def initial_offsets(
    starting: Starting, topics: Sequence[str], bounds: Mapping[str, Bounds | None]
) -> dict[str, StreamPosition]:
    """The offset a fresh query starts from: per stream, the last sequence taken as read."""
    offsets = {}
    for topic in topics:
        stream = topic_stream(topic)
        found = require(bounds, stream, topic)
        first = starting if isinstance(starting, str) else starting[topic]
        if first in (EARLIEST, _EARLIEST_SEQ):
            seq = max(found.first - 1, 0)
        elif first in (LATEST, _LATEST_SEQ):
            seq = found.last
        else:
            seq = int(first) - 1
        offsets[stream] = StreamPosition(seq, found.created)
    return offsets


def as_starting(offsets: Mapping[str, StreamPosition], topics: Sequence[str]) -> dict[str, int]:
    """Offsets back as a JSON start ({topic: first sequence to read}): pinned by the job."""
    return {t: offsets[topic_stream(t)].seq + 1 for t in topics}


def require(bounds: Mapping[str, Bounds | None], stream: str, topic: str) -> Bounds:
    found = bounds.get(stream)
    if found is None:
        raise StreamMissing(
            f"topic {topic!r} has no stream {stream} on the server: nothing was ever "
            "committed to it, or the name is misspelt (the sink never creates streams)"
        )
    return found


@dataclass(frozen=True, slots=True)
class StreamPosition:
    """One stream's entry in an offset: the last sequence read, and which stream it was read from.

    `created` is the stream's creation time (stream info's `created`, ISO 8601): a stream deleted
    and created again restarts its sequences at 1 under the same name, and only its creation
    time tells the two apart. None in checkpoints written before the sink kept it.
    """

    seq: int
    created: str | None = None

    def encode(self) -> dict[str, object]:
        return {"seq": self.seq, "created": self.created}

    @classmethod
    def decode(cls, value: object) -> StreamPosition:
        """An offset entry as Spark hands it back: `{"seq": n, "created": …}`, or a bare
        sequence (checkpoints from before the identity was kept)."""
        if isinstance(value, dict):
            created = value.get("created")
            return cls(int(value["seq"]), None if created is None else str(created))
        if isinstance(value, int | str) and not isinstance(value, bool):
            return cls(int(value))
        raise SinkError(f"not a txactors source offset entry: {value!r}")


def encode_offset(positions: Mapping[str, StreamPosition]) -> dict[str, dict[str, object]]:
    return {stream: position.encode() for stream, position in positions.items()}


def decode_offset(offset: Mapping[str, object]) -> dict[str, StreamPosition]:
    return {str(stream): StreamPosition.decode(value) for stream, value in offset.items()}


def head_positions(bounds: Mapping[str, Bounds]) -> dict[str, StreamPosition]:
    """Each stream's last sequence, with its identity."""
    return {stream: StreamPosition(b.last, b.created) for stream, b in bounds.items()}


def replaced(read: StreamPosition, created: str | None, last: int) -> bool:
    """Whether the stream now created at `created`, ending at `last`, is not the one `read` was
    read from: another creation time, or (for a position without one) fewer sequences than
    were read. A stream only grows and a purge keeps its last sequence, so only a stream
    deleted and created again ends below what was read."""
    if read.created is not None and created is not None and created != read.created:
        return True
    return last < read.seq


def first_to_read(start: StreamPosition, end: StreamPosition) -> int:
    """The first sequence of a batch from `start` to `end`: the new stream's beginning when
    the stream was replaced in between."""
    return 1 if replaced(start, end.created, end.seq) else start.seq + 1


@dataclass(frozen=True, slots=True)
class Purged:
    """Sequences [first, last] of `topic`'s stream purged before the query read them."""

    topic: str
    first: int
    last: int

    def describe(self) -> str:
        return (
            f"{topic_stream(self.topic)}: sequences {self.first:,}..{self.last:,} were purged "
            f"before the sink read them (the stream now starts at {self.last + 1:,})"
        )

    def skipping(self) -> str:
        return f"{self.describe()}; skipped (failOnDataLoss=false)"

    @property
    def key(self) -> tuple[object, ...]:
        """Said once per key: more sequences purged later is news."""
        return (self.topic, self.first, self.last)

    def advice(self) -> str:
        return (
            "keep messages until they are sunk (the stream's retention), or skip them with "
            "failOnDataLoss=false (--no-fail-on-data-loss)"
        )


@dataclass(frozen=True, slots=True)
class Replaced:
    """`topic`'s stream was deleted and created again after the query read `read` of it."""

    topic: str
    read: StreamPosition
    now: Bounds

    def describe(self) -> str:
        was = f", created {self.read.created}," if self.read.created else ""
        return (
            f"topic {self.topic!r}: {topic_stream(self.topic)} was deleted and created again: "
            f"the sink read the old stream{was} up to sequence {self.read.seq:,}; the new one, "
            f"created {self.now.created}, holds sequences {self.now.first:,}..{self.now.last:,}"
        )

    def skipping(self) -> str:
        return (
            f"{self.describe()}; reading the new stream from its first sequence "
            "(failOnDataLoss=false)"
        )

    @property
    def key(self) -> tuple[object, ...]:
        """Said once per key: the new stream growing is not news, another replacement is."""
        return (self.topic, self.read, self.now.created)

    def advice(self) -> str:
        return (
            "read the new stream from its first sequence with failOnDataLoss=false "
            "(--no-fail-on-data-loss)"
        )


Loss = Purged | Replaced


def losses(
    topics: Sequence[str],
    start: Mapping[str, StreamPosition],
    bounds: Mapping[str, Bounds | None],
) -> list[Loss]:
    """What the streams lost between `start` (what was read) and now: each stream replaced by
    another of the same name, or sequences purged by retention before they were read."""
    found: list[Loss] = []
    for topic in topics:
        stream = topic_stream(topic)
        read, held = start.get(stream), bounds.get(stream)
        if read is None or held is None:
            continue
        if replaced(read, held.created, held.last):
            found.append(Replaced(topic, read, held))
        elif held.first > read.seq + 1:
            found.append(Purged(topic, read.seq + 1, held.first - 1))
    return found


def data_loss_error(found: Sequence[Loss]) -> str:
    """One line: what was lost, and what to do (DataLoss's message)."""
    advice = dict.fromkeys(loss.advice() for loss in found)  # in order, each once
    return "; ".join(loss.describe() for loss in found) + ": " + "; ".join(advice)
