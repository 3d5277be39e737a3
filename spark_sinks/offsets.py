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
first sequence moved past `offset + 1`) before the query read them. Pure logic; the source and
the job bring the stream bounds.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from spark_sinks.errors import SinkError, StreamMissing
from spark_sinks.jetstream_read import Bounds
from txactors.layout import topic_stream

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
) -> dict[str, int]:
    """The offset a fresh query starts from: per stream, the last sequence taken as read."""
    offsets = {}
    for topic in topics:
        stream = topic_stream(topic)
        found = require(bounds, stream, topic)
        first = starting if isinstance(starting, str) else starting[topic]
        if first in (EARLIEST, _EARLIEST_SEQ):
            offsets[stream] = max(found.first - 1, 0)
        elif first in (LATEST, _LATEST_SEQ):
            offsets[stream] = found.last
        else:
            offsets[stream] = int(first) - 1
    return offsets


def as_starting(offsets: Mapping[str, int], topics: Sequence[str]) -> dict[str, int]:
    """Offsets back as a JSON start ({topic: first sequence to read}): pinned by the job."""
    return {t: offsets[topic_stream(t)] + 1 for t in topics}


def require(bounds: Mapping[str, Bounds | None], stream: str, topic: str) -> Bounds:
    found = bounds.get(stream)
    if found is None:
        raise StreamMissing(
            f"topic {topic!r} has no stream {stream} on the server: nothing was ever "
            "committed to it, or the name is misspelt (the sink never creates streams)"
        )
    return found


@dataclass(frozen=True, slots=True)
class Loss:
    """Sequences [first, last] of `stream` purged before the query read them."""

    stream: str
    first: int
    last: int

    def describe(self) -> str:
        return (
            f"{self.stream}: sequences {self.first:,}..{self.last:,} were purged before the "
            f"sink read them (the stream now starts at {self.last + 1:,})"
        )


def lost(start: Mapping[str, int], bounds: Mapping[str, Bounds | None]) -> list[Loss]:
    """What retention took from the streams between `start` (offsets read) and their heads."""
    found = []
    for stream, offset in start.items():
        held = bounds.get(stream)
        if held is not None and held.first > offset + 1:
            found.append(Loss(stream, offset + 1, held.first - 1))
    return found


def check_not_rewound(start: Mapping[str, int], bounds: Mapping[str, Bounds | None]) -> None:
    """A stream that ends before the offset was deleted and re-created: offsets mean nothing."""
    for stream, offset in start.items():
        held = bounds.get(stream)
        if held is not None and held.last < offset:
            raise SinkError(
                f"{stream} ends at sequence {held.last:,} but the query has read up to "
                f"{offset:,}: the stream was deleted and re-created; start over with a new "
                "checkpoint location"
            )


def data_loss_error(losses: Sequence[Loss]) -> str:
    return (
        "; ".join(loss.describe() for loss in losses)
        + ": keep messages until they are sunk (the stream's retention), or skip them with "
        "failOnDataLoss=false (--no-fail-on-data-loss)"
    )
