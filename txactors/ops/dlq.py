"""Operator access to dead letters: list, show and replay the entries of a group's DLQ.

A consumer group dead-letters what it gave up on into `DLQ_<group>` (txactors/consumer/dlq.py).
Once the cause is fixed, `replay` publishes an entry again on its original topic subject and
deletes it from the DLQ. The copy is meant for that group only and must not be delivered twice:

- `Nats-Msg-Id: replay:<group>:<dlq seq>:<original id>`: new to the topic stream, so it is
  not dropped as the original's duplicate, yet the same on every replay of that entry, so a
  replay repeated within the topic's duplicate window (the first one stored, then the process
  died before deleting the entry) is dropped by the stream;
- `Txn-Replay-Group: <group>`: every other group's consumer acks it unhandled, since it already
  had the original; `Txn-Replay-Of` names the original's id.

An entry stored by reference (`Txn-Omitted`) is replayed from the original, read back at
`Txn-Origin-Stream`/`Txn-Origin-Seq`; if the topic stream no longer keeps it, nothing can be
replayed and the replay says so. How entries are shown is `dlq_views.py`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg, StreamState

from txactors.errors import ConfigError, TxActorsError
from txactors.wire.copies import copied_headers, stored_headers
from txactors.wire.framing import header_block_bytes
from txactors.wire.layout import (
    DELIVERIES_HEADER,
    DLQ_OMITTED_HEADER,
    ERROR_HEADER,
    MSG_ID_HEADER,
    ORIGIN_SEQ_HEADER,
    ORIGIN_STREAM_HEADER,
    REPLAY_GROUP_HEADER,
    REPLAY_OF_HEADER,
    TAG_HEADER,
    TOPIC_HEADER,
    TXID_HEADER,
    dlq_filter,
    dlq_stream,
    topic_stream,
    topic_subject,
    validate_name,
)

DLQ_ONLY_HEADERS: Final = frozenset(
    {
        TOPIC_HEADER,
        ORIGIN_STREAM_HEADER,
        ORIGIN_SEQ_HEADER,
        ERROR_HEADER,
        DELIVERIES_HEADER,
        DLQ_OMITTED_HEADER,
        REPLAY_GROUP_HEADER,
        REPLAY_OF_HEADER,
    }
)
"""Headers the dead letter (or an earlier replay) added: not carried into the replayed copy,
nor any of the server's (`copies.copied_headers`: JetStream would act on them again)."""
DEFAULT_LIMIT: Final = 100
DLQ_SERVER: Final = "the server the consumer groups' dead-letter streams (DLQ_<group>) are on"
"""Which server `txactors dlq` names in its errors (`admin_session(server=...)`): dead
letters need no coordinator."""


class DeadLetterError(TxActorsError):
    """A dead letter that cannot be read or replayed; the message says which and why."""


class DeadLetterInfo(msgspec.Struct, kw_only=True):
    """One DLQ entry as an operator sees it (`body` only when shown in full)."""

    group: str
    seq: int
    topic: str
    stored_at: float
    """Seconds since the epoch when it was dead-lettered."""
    msg_id: str | None
    txid: str | None
    error: str | None
    deliveries: int | None
    origin_stream: str | None
    origin_seq: int | None
    omitted: list[str]
    """What the entry leaves out (stored by reference): [], ["body"] or ["body", "headers"]."""
    size: int
    """Bytes of the body as stored (0 when the body is omitted)."""
    headers: dict[str, str]
    body: bytes | None = None


class DeadLetterPage(msgspec.Struct, kw_only=True):
    entries: list[DeadLetterInfo]
    total: int
    """Entries in the DLQ now."""
    next_seq: int | None
    """Where the next page starts (`--from`), or None when this page reached the end."""


class Replayed(msgspec.Struct, kw_only=True):
    """The outcome of one replay: where the copy went, or why it was not replayed."""

    seq: int
    topic: str | None = None
    topic_seq: int | None = None
    """The copy's sequence in the topic stream."""
    duplicate: bool = False
    """The topic stream already had this replay (an earlier one did not delete the entry)."""
    error: str | None = None


class DlqSummary(msgspec.Struct, kw_only=True):
    group: str
    entries: int
    first_seq: int | None
    """None when empty (JetStream then says first = last + 1, which reads like an entry)."""
    last_seq: int | None


# -- reading --------------------------------------------------------------------------------


async def dlq_summaries(nc: Client) -> list[DlqSummary]:
    """Every group's DLQ on the server, with how many entries it holds."""
    infos = await nc.jetstream().streams_info()
    summaries = [
        DlqSummary(
            group=info.config.name.removeprefix(dlq_stream("")),
            entries=info.state.messages,
            first_seq=info.state.first_seq if info.state.messages else None,
            last_seq=info.state.last_seq if info.state.messages else None,
        )
        for info in infos
        if info.config.name and info.config.name.startswith(dlq_stream(""))
    ]
    return sorted(summaries, key=lambda s: s.group)


async def list_dead_letters(
    nc: Client, group: str, *, start: int = 1, limit: int = DEFAULT_LIMIT
) -> DeadLetterPage:
    """Up to `limit` entries of the group's DLQ from sequence `start` on, oldest first."""
    if limit < 1:
        raise ConfigError(f"limit must be >= 1, got {limit}")
    js = nc.jetstream()
    stream, state = await _dlq_stream(js, group)
    entries: list[DeadLetterInfo] = []
    seq = max(start, 1)
    while len(entries) < limit and seq <= state.last_seq:
        raw = await _next_entry(js, stream, group, seq)
        if raw is None or raw.seq is None:
            break
        entries.append(_info(group, raw, with_body=False))
        seq = raw.seq + 1
    more = seq <= state.last_seq and len(entries) == limit
    return DeadLetterPage(entries=entries, total=state.messages, next_seq=seq if more else None)


async def show_dead_letter(nc: Client, group: str, seq: int) -> DeadLetterInfo:
    """One entry in full, body included."""
    js = nc.jetstream()
    stream, _ = await _dlq_stream(js, group)
    return _info(group, await _entry(js, stream, seq), with_body=True)


# -- replaying ------------------------------------------------------------------------------


async def replay(nc: Client, group: str, seqs: Iterable[int]) -> list[Replayed]:
    """Replay each entry in turn (in the order given); one outcome per sequence. A failure
    fails only its own entry, which then stays in the DLQ."""
    js = nc.jetstream()
    stream, _ = await _dlq_stream(js, group)
    results = []
    for seq in seqs:
        try:
            results.append(await _replay_one(nc, js, stream, group, seq))
        except DeadLetterError as exc:
            results.append(Replayed(seq=seq, error=str(exc)))
    return results


async def all_sequences(nc: Client, group: str) -> list[int]:
    """The sequences in the group's DLQ now. Entries dead-lettered later (a replayed message
    that fails again) are not among them, so `replay --all` ends."""
    js = nc.jetstream()
    stream, state = await _dlq_stream(js, group)
    last = state.last_seq
    seqs: list[int] = []
    seq = 1
    while seq <= last:
        raw = await _next_entry(js, stream, group, seq)
        if raw is None or raw.seq is None or raw.seq > last:
            break
        seqs.append(raw.seq)
        seq = raw.seq + 1
    return seqs


async def _replay_one(
    nc: Client, js: JetStreamContext, stream: str, group: str, seq: int
) -> Replayed:
    entry = await _entry(js, stream, seq)
    info = _info(group, entry, with_body=True)
    subject, body, headers = await _original(js, info)
    original_id = (
        info.headers.get(REPLAY_OF_HEADER)
        or info.msg_id
        or f"{info.origin_stream or topic_stream(info.topic)}:{info.origin_seq}"
    )
    copy = {k: v for k, v in copied_headers(headers).items() if k not in DLQ_ONLY_HEADERS}
    copy[MSG_ID_HEADER] = replay_id(group, seq, original_id)
    copy[REPLAY_GROUP_HEADER] = group
    copy[REPLAY_OF_HEADER] = original_id
    size = header_block_bytes(copy) + len(body)
    if size > nc.max_payload:
        raise DeadLetterError(
            f"{entry_name(group, seq)}: the replayed copy would take {size} bytes, more than the "
            f"server's max_payload {nc.max_payload}"
        )
    try:
        # No expected-stream header: the copy keeps its headers, and one that failed again
        # would carry it into the DLQ, which would refuse it.
        ack = await js.publish(subject, body, headers=copy)
    except (nats.errors.Error, TimeoutError) as exc:
        raise DeadLetterError(
            f"{entry_name(group, seq)}: not replayed, publishing to {subject} failed: {exc!r}"
        ) from exc
    try:
        await js.delete_msg(stream, seq)
    except (nats.errors.Error, TimeoutError) as exc:
        raise DeadLetterError(
            f"{entry_name(group, seq)}: replayed to {topic_stream(info.topic)} seq {ack.seq}, but "
            f"not deleted ({exc!r}); replaying it again is dropped as a duplicate for "
            "the topic's duplicate window"
        ) from exc
    return Replayed(seq=seq, topic=info.topic, topic_seq=ack.seq, duplicate=bool(ack.duplicate))


def replay_id(group: str, seq: int, original_id: str) -> str:
    """The replayed copy's `Nats-Msg-Id`: new to the topic, the same for every replay of it."""
    return f"replay:{group}:{seq}:{original_id}"


async def _original(
    js: JetStreamContext, info: DeadLetterInfo
) -> tuple[str, bytes, dict[str, str]]:
    """The subject, body and headers to replay: the entry's own, or for an entry stored by
    reference, the original's as its topic stream still keeps it."""
    if not info.omitted:
        assert info.body is not None
        return topic_subject(info.topic, info.headers.get(TAG_HEADER)), info.body, info.headers
    left_out = ", ".join(info.omitted)
    where = f"{entry_name(info.group, info.seq)} is stored by reference ({left_out} left out)"
    if info.origin_stream is None or info.origin_seq is None:
        raise DeadLetterError(f"{where}, but does not say where its original is")
    try:
        original = await js.get_msg(info.origin_stream, info.origin_seq)
    except nats.js.errors.NotFoundError:
        raise DeadLetterError(
            f"{where}, and its original ({info.origin_stream} seq {info.origin_seq}) is gone: "
            "the topic stream no longer keeps it, so it cannot be replayed"
        ) from None
    headers = stored_headers(original)
    if info.msg_id is not None and headers.get(MSG_ID_HEADER) != info.msg_id:
        raise DeadLetterError(
            f"{where}, but {info.origin_stream} seq {info.origin_seq} is another message "
            f"(Nats-Msg-Id {headers.get(MSG_ID_HEADER)!r}, not {info.msg_id!r})"
        )
    assert original.subject is not None
    return original.subject, original.data or b"", headers


# -- JetStream access -----------------------------------------------------------------------


async def _dlq_stream(js: JetStreamContext, group: str) -> tuple[str, StreamState]:
    """The name of the group's DLQ stream and what it holds now."""
    try:
        stream = dlq_stream(validate_name("group", group))
    except ValueError as exc:
        raise DeadLetterError(str(exc)) from None
    try:
        info = await js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        raise DeadLetterError(
            f"group {group} has no dead-letter stream ({stream}): none of its consumers has "
            "run on this server (see `txactors dlq list` for the groups that have one)"
        ) from None
    return stream, info.state


async def _entry(js: JetStreamContext, stream: str, seq: int) -> RawStreamMsg:
    try:
        return await js.get_msg(stream, seq)
    except nats.js.errors.NotFoundError:
        raise DeadLetterError(
            f"{stream} has no entry {seq} (replayed or deleted already?)"
        ) from None


async def _next_entry(
    js: JetStreamContext, stream: str, group: str, seq: int
) -> RawStreamMsg | None:
    try:
        return await js.get_msg(stream, seq, subject=dlq_filter(group), next=True)
    except nats.js.errors.NotFoundError:
        return None


def entry_name(group: str, seq: int) -> str:
    """How messages name a DLQ entry: `DLQ_<group> entry <seq>`."""
    return f"{dlq_stream(group)} entry {seq}"


def _info(group: str, raw: RawStreamMsg, *, with_body: bool) -> DeadLetterInfo:
    headers = stored_headers(raw)
    subject = raw.subject or ""
    omitted = headers.get(DLQ_OMITTED_HEADER, "")
    body = raw.data or b""
    return DeadLetterInfo(
        group=group,
        seq=raw.seq or 0,
        topic=headers.get(TOPIC_HEADER) or subject.removeprefix(f"dlq.{group}."),
        stored_at=raw.time.timestamp() if raw.time else 0.0,
        msg_id=headers.get(MSG_ID_HEADER),
        txid=headers.get(TXID_HEADER),
        error=headers.get(ERROR_HEADER),
        deliveries=_int(headers.get(DELIVERIES_HEADER)),
        origin_stream=headers.get(ORIGIN_STREAM_HEADER),
        origin_seq=_int(headers.get(ORIGIN_SEQ_HEADER)),
        omitted=[part for part in omitted.split(",") if part],
        size=len(body),
        headers=headers,
        body=body if with_body else None,
    )


def _int(value: str | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None
