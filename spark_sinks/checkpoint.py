"""What a topic's query checkpoint says, read before Spark starts.

Spark keeps, per query, `offsets/<batch>` (written before the batch runs) and `commits/<batch>`
(written once its output is committed); each offsets file is `v1`, a metadata line, then the
source's offset as JSON (ours: `{"TOPIC_transfers": {"seq": 1200, "created": "…"}}`, or
`{"TOPIC_transfers": 1200}` in checkpoints from before the stream's identity was kept).
Reading them lets the job tell, without starting a JVM, whether a topic is caught up (nothing
planned, nothing new) or lost sequences, and lets `txactors sink run` show what a running
batch reads.

The job also pins a query's resolved `startingOffsets` here (`txactors-start.json`), with the
creation time of the stream it was resolved against: Spark asks a Python source for its
initial offset again when the query's first batch is re-run after a crash, and `latest` must
mean the same then as it did the first time (and on the same stream).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from spark_sinks.errors import SinkError
from spark_sinks.offsets import StreamPosition, decode_offset

PINNED_START: Final = "txactors-start.json"


@dataclass(frozen=True, slots=True)
class Position:
    """A query's last committed batch and offsets, and a batch planned after it, if any."""

    committed_batch: int | None
    committed: dict[str, StreamPosition] | None
    planned_batch: int | None
    planned: dict[str, StreamPosition] | None


def position(checkpoint: Path) -> Position:
    """Where the query of `checkpoint` stands (all None for a query that never ran)."""
    done = _latest(checkpoint / "commits")
    last = _latest(checkpoint / "offsets")
    committed = None if done is None else offsets_of(checkpoint, done)
    pending = last if last is not None and (done is None or last > done) else None
    planned = None if pending is None else offsets_of(checkpoint, pending)
    return Position(done, committed, pending, planned)


def offsets_of(checkpoint: Path, batch: int) -> dict[str, StreamPosition] | None:
    """The end offsets of `batch` (None if its file is gone or not ours)."""
    try:
        lines = (checkpoint / "offsets" / str(batch)).read_text().splitlines()
        found = json.loads(lines[2])
        return decode_offset(found) if isinstance(found, dict) else None
    except (OSError, IndexError, json.JSONDecodeError, SinkError, KeyError, ValueError):
        return None


def _latest(log: Path) -> int | None:
    if not log.is_dir():
        return None
    ids = [int(p.name) for p in log.iterdir() if p.name.isdigit()]
    return max(ids, default=None)


@dataclass(frozen=True, slots=True)
class PinnedStart:
    """A new query's resolved start ({topic: first sequence to read}), and the creation time
    of the stream it was resolved against (None in pins from before the sink kept it)."""

    start: dict[str, int]
    created: str | None = None


def pinned_start(checkpoint: Path) -> PinnedStart | None:
    """The pin: `{"start": {topic: seq}, "created": …}`, or the older bare `{topic: seq}`."""
    try:
        found = json.loads((checkpoint / PINNED_START).read_text())
        if not isinstance(found, dict):
            return None
        if isinstance(found.get("start"), dict):
            created = found.get("created")
            start = {str(k): int(v) for k, v in found["start"].items()}
            return PinnedStart(start, None if created is None else str(created))
        return PinnedStart({str(k): int(v) for k, v in found.items()})
    except (OSError, json.JSONDecodeError, TypeError, ValueError):
        return None


def pin_start(checkpoint: Path, pinned: PinnedStart) -> None:
    checkpoint.mkdir(parents=True, exist_ok=True)
    tmp = checkpoint / f".{PINNED_START}.tmp"
    tmp.write_text(json.dumps({"start": pinned.start, "created": pinned.created}))
    tmp.replace(checkpoint / PINNED_START)
