"""How many partitions there are: the coordinators publish it, every client reads it.

A txid belongs to partition `crc32(txid) mod P`, so a producer or an operator command that
uses another P than the coordinators sends a transaction where nobody serves it. So P is
configured once, on the coordinators: the first one to start writes it to the key
`partitions` of the KV bucket TXN_META (create only if absent), and every later one must
have the same count or refuses to start (coordinator/cluster/agreement.py), and the running ones put
back any other value written there. A client reads it with one JetStream direct get
(`layout.partitions_read_subject()`), the one JetStream subject a producer needs to be
allowed; a count the client was given is an override, checked against the published one.
Any count, read or given, is 1 to `layout.MAX_PARTITION_COUNT`: on a server without
permissions anyone may write the key, and a client sizes its work by it.
"""

from __future__ import annotations

import asyncio

import nats.errors
from nats.aio.client import Client

from txactors.errors import ConfigError
from txactors.observe.logs import get_logger
from txactors.wire import layout

log = get_logger(__name__)

_GONE = frozenset({"DEL", "PURGE"})
"""`KV-Operation` of a deleted key: its last message is a marker, not a count."""


class PartitionCountMismatch(ConfigError):
    """A configured partition count disagrees with the one the coordinators published."""


class PartitionCountUnknown(ConfigError):
    """No count is published (no coordinator started yet), or it could not be read."""


class PartitionCountInvalid(ConfigError):
    """The published count is not a count: not a decimal, or outside 1 to MAX_PARTITION_COUNT."""


_MOST_DIGITS = len(str(layout.MAX_PARTITION_COUNT))
COUNT_RANGE = f"1 to {layout.MAX_PARTITION_COUNT}"


def where_published() -> str:
    """The key, named for error messages (and for `nats kv get`)."""
    return f"key {layout.PARTITIONS_KEY!r} of KV bucket {layout.META_BUCKET}"


def check_count(count: int) -> int:
    """`count`, if a partition count may be it; ConfigError if not."""
    if not 1 <= count <= layout.MAX_PARTITION_COUNT:
        raise ConfigError(f"partitions must be {COUNT_RANGE}, not {count}")
    return count


def parse_count(value: bytes) -> int:
    """The count a key's value holds; PartitionCountInvalid (naming the key and the value)
    unless it is a decimal from 1 to MAX_PARTITION_COUNT. Its length is looked at before
    its value: a huge number is refused without being converted."""
    text = value.decode("ascii", errors="replace").strip()
    digits = text.lstrip("0")
    if text.isdigit() and text.isascii() and len(digits) <= _MOST_DIGITS:
        count = int(text)
        if 1 <= count <= layout.MAX_PARTITION_COUNT:
            return count
    raise PartitionCountInvalid(
        f"the {where_published()} holds {layout.shown(text)}, not a partition count "
        f"({COUNT_RANGE}); the coordinators put theirs back while one runs (see "
        "docs/operations.md, Partitions)"
    )


async def read_published(nc: Client, timeout: float) -> int | None:
    """The count the coordinators published; None if none is (the bucket or key is absent).

    Raises PartitionCountUnknown when there is no answer within `timeout` (most often: this
    user may not publish to the read subject, so the server drops the request)."""
    subject = layout.partitions_read_subject()
    try:
        reply = await nc.request(subject, b"", timeout=timeout)
    except nats.errors.NoRespondersError:  # no TXN_META bucket: no coordinator ever ran here
        return None
    except nats.errors.TimeoutError:
        raise PartitionCountUnknown(
            f"the partition count ({where_published()}) could not be read within {timeout:g}s: "
            f"may this NATS user publish to {subject}? (docs/operations.md, Partitions)"
        ) from None
    headers = reply.headers or {}
    if headers.get("KV-Operation") in _GONE or headers.get("Status") == "404":
        return None
    if "Status" in headers:
        raise PartitionCountUnknown(
            f"reading the partition count ({where_published()}) was answered "
            f"{headers['Status']} {headers.get('Description', '')}".rstrip()
        )
    return parse_count(reply.data)


def agreed_count(published: int | None, configured: int | None) -> int | None:
    """The count a client uses: the published one, which a configured one must equal; the
    configured one while none is published; None if neither is known."""
    if configured is not None:
        check_count(configured)
    if published is None:
        return configured
    if configured is not None and configured != published:
        raise PartitionCountMismatch(
            f"partitions is set to {configured} here, but the coordinators use {published} "
            f"({where_published()}): drop the setting (the published count is read) or make "
            "it agree"
        )
    return published


async def client_count(nc: Client, configured: int | None, timeout: float) -> int:
    """The partition count for a client (see `agreed_count`); PartitionCountUnknown if none is
    published and none configured. A configured count is used unchecked if the published one
    cannot be read (a user not allowed to), with a warning."""
    try:
        published = await read_published(nc, timeout)
    except PartitionCountUnknown as unreadable:
        if configured is None:
            raise
        log.warning("partition_count_unchecked", partitions=configured, error=str(unreadable))
        published = None
    count = agreed_count(published, configured)
    if count is None:
        raise PartitionCountUnknown(
            f"no coordinator has published its partition count ({where_published()}): is "
            "`txactors coordinator` running on this NATS server?"
        )
    return count


class PartitionCount:
    """A client's partition count, read the first time it is needed and kept from then on."""

    def __init__(self, nc: Client, configured: int | None, timeout: float) -> None:
        if configured is not None:
            check_count(configured)
        self._nc = nc
        self._configured = configured
        self._timeout = timeout
        self._known: int | None = None
        self._reading: asyncio.Future[int] | None = None

    async def get(self) -> int:
        """The count (see `client_count`); raises as it does, and then asks again next time.

        Callers that ask while it is being read share that one read, so a burst of first
        calls resumes in one loop turn (and goes out as one round) instead of one read each,
        answered one by one; a caller cancelled meanwhile does not cancel the others' read."""
        if self._known is None:
            if self._reading is None:
                self._reading = asyncio.ensure_future(
                    client_count(self._nc, self._configured, self._timeout)
                )
                # its error is its waiters'; with every waiter cancelled, nobody's to log
                self._reading.add_done_callback(lambda read: read.cancelled() or read.exception())
            reading = self._reading
            try:
                self._known = await asyncio.shield(reading)
            finally:
                if reading.done() and self._reading is reading:
                    self._reading = None  # read or failed: a failure is asked again next time
        return self._known
