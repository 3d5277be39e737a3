"""Where things live on NATS: stream names, subjects, KV buckets and header names.

DESIGN §4 in code. Every subject, stream name and header used by more than one role is
defined here and nowhere else, so a producer, the coordinator, a consumer and a client in
another language (docs/protocol.md) agree by construction.
"""

from __future__ import annotations

import functools
import re
import zlib
from typing import Final, NamedTuple

from txactors.errors import ConfigError

# -- streams and buckets --------------------------------------------------------------------

LEGACY_HALF_STREAM: Final = "TXN_HALF"
LEGACY_OP_STREAM: Final = "TXN_OP"
"""The shared layout of 0.2 and before: every partition's halves (op records) in one
stream. A coordinator upgrading a deployment finishes what they hold (`partition/upgrade.py`)
and writes only the per-partition streams."""
DISCARD_STREAM: Final = "TXN_DISCARD"
CHECKPOINT_BUCKET: Final = "TXN_CHECKPOINT"
LEASE_BUCKET: Final = "TXN_LEASE"
META_BUCKET: Final = "TXN_META"
"""What the coordinators agree on and every client reads: the partition count."""
PARTITIONS_KEY: Final = "partitions"
"""Key of META_BUCKET: the partition count, an ASCII decimal."""
MAX_PARTITION_COUNT: Final = 4096
"""The largest partition count a coordinator accepts or a client reads. The key may be
written by any client a server lets publish to `$KV.TXN_META.>`, so every reader bounds what
it finds: a producer's links, a lease per partition and a txid chosen per partition
(producer/sticky.py tries 4,096 tails) all grow with the count."""


def bucket_stream(bucket: str) -> str:
    """The stream that holds KV bucket `bucket`."""
    return f"KV_{bucket}"


def bucket_key_prefix(bucket: str) -> str:
    """The subject prefix of KV bucket `bucket`'s keys (a key's subject is the prefix, then the
    key)."""
    return f"$KV.{bucket}."


def partitions_read_subject() -> str:
    """Where any client reads the partition count: a JetStream direct get of the key's last
    value (an empty request; the answer is the value, or status 404 while none is published).
    The one JetStream subject a producer must be allowed to publish to."""
    key = f"{bucket_key_prefix(META_BUCKET)}{PARTITIONS_KEY}"
    return f"$JS.API.DIRECT.GET.{bucket_stream(META_BUCKET)}.{key}"


JS_API: Final = "$JS.API"
"""JetStream's API subject prefix (a JetStream domain has another: nats-py's `js._prefix`)."""


def leader_stepdown_subject(stream: str, api: str = JS_API) -> str:
    """Where an operator (or the coordinator's balancer) asks `stream`'s leader to step down."""
    return f"{api}.STREAM.LEADER.STEPDOWN.{stream}"


def pull_subject(stream: str, consumer: str) -> str:
    """Where a pull consumer asks JetStream for its next messages."""
    return f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"


def log_stream(partition: int) -> str:
    """The stream of `partition`'s log: its half messages (`half_subject`) and its op records
    (`op_subject`). Each partition's log stands alone (its own raft group on a cluster, its
    leader on any node), so a node loss pauses only the partitions whose logs it led."""
    return f"TXN_LOG_{partition}"


def half_stream(partition: int) -> str:
    """The stream holding `partition`'s half messages: its log."""
    return log_stream(partition)


def op_stream(partition: int) -> str:
    """The stream holding `partition`'s op records: its log."""
    return log_stream(partition)


class LogStreams(NamedTuple):
    """The streams holding a partition's halves and its op records: one, its log (two in the
    shared layout of 0.2, where every partition shared them)."""

    half: str
    op: str

    @classmethod
    def of(cls, partition: int) -> LogStreams:
        return cls(half_stream(partition), op_stream(partition))

    @classmethod
    def legacy(cls) -> LogStreams:
        """Where 0.2 kept every partition's log (`partition/upgrade.py` finishes it)."""
        return cls(LEGACY_HALF_STREAM, LEGACY_OP_STREAM)


def half_subject(partition: int) -> str:
    return f"txn.half.{partition}"


def legacy_half_filter() -> str:
    """The subjects LEGACY_HALF_STREAM held: every partition's `half_subject`."""
    return "txn.half.*"


def legacy_op_filter() -> str:
    """The subjects LEGACY_OP_STREAM held: every partition's `op_subject`."""
    return "txn.op.*"


def discard_subject_filter() -> str:
    return "txn.discard.*"


def quarantine_subject() -> str:
    """Where the coordinator keeps records JetStream refused or it could not read (in
    TXN_DISCARD; `$` keeps it apart from every group's `txn.discard.<group>`)."""
    return "txn.discard.$quarantine"


def op_subject(partition: int) -> str:
    return f"txn.op.{partition}"


def discard_subject(group: str) -> str:
    return f"txn.discard.{group}"


# -- commands (core NATS request/reply) -----------------------------------------------------


def prepare_subject(partition: int, group: str) -> str:
    """Where a producer of `group` prepares: `txn.coord.<p>.prepare.<group>`, so that NATS
    permissions can confine a group to its own subjects. (The subject without a group, which
    no one could confine, was removed in 0.x: nothing serves it.)"""
    return f"txn.coord.{partition}.prepare.{group}"


def end_subject(partition: int, group: str) -> str:
    """Where a producer of `group` ends its transactions (see `prepare_subject`)."""
    return f"txn.coord.{partition}.end.{group}"


def prepare_filter(partition: int) -> str:
    """What the coordinator of `partition` serves for every group's prepares."""
    return prepare_subject(partition, "*")


def end_filter(partition: int) -> str:
    return end_subject(partition, "*")


@functools.lru_cache(maxsize=1024)
def subject_group(subject: str) -> str | None:
    """The producer group a prepare or end subject names (None: not such a subject).
    Remembered: a group's few subjects come with every item of every batch."""
    tokens = subject.split(".")
    if len(tokens) == 5 and tokens[:2] == ["txn", "coord"] and tokens[3] in ("prepare", "end"):
        return tokens[4]
    return None


def admin_subject(partition: int) -> str:
    return f"txn.coord.{partition}.admin"


def check_group_subject(group: str) -> str:
    """Check-backs for any live member of `group` (served as a queue group)."""
    return f"txn.check.{group}"


def check_instance_subject(group: str, instance: str) -> str:
    """Check-backs for the one producer instance that prepared the transaction."""
    return f"txn.check.{group}.{instance}"


# -- the name grammar -----------------------------------------------------------------------
# Names become NATS subject tokens, stream names and header values, so they are kept to a
# small ASCII alphabet and a length that keeps every subject built from them (the longest
# is `txn.check.<group>.<producer>`) far below the server's 4 KiB control-line limit.

NAME_MAX_LENGTH: Final = {
    "txid": 128,
    "group": 64,
    "producer": 128,
    "instance": 128,
    "topic": 64,
    "tag": 64,
}
"""The longest name of each kind; the producer's instance id is its `producer` name."""
_NAME = re.compile(r"[A-Za-z0-9_-]+")
NAME_GRAMMAR: Final = "letters, digits, '_' and '-'"


def name_problem(kind: str, name: str) -> str | None:
    """What is wrong with `name` as a `kind` (a key of NAME_MAX_LENGTH); None: nothing."""
    limit = NAME_MAX_LENGTH[kind]
    if not _NAME.fullmatch(name) or len(name) > limit:
        return (
            f"{kind} {shown(name)} may contain only {NAME_GRAMMAR}, 1 to {limit} of them "
            "(it becomes a NATS subject token and part of a stream name)"
        )
    return None


def validate_name(kind: str, name: str) -> str:
    """`name` if it is a valid `kind` (see `name_problem`), else ConfigError saying why."""
    problem = name_problem(kind, name)
    if problem is not None:
        raise ConfigError(problem)
    return name


def shown(text: str, limit: int = 40) -> str:
    """`text` for an error message: quoted, and cut short if a client made it huge."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} chars)"


# -- committed topics -----------------------------------------------------------------------

NO_TAG: Final = "_"
"""Subject token for a message without a tag (NATS tokens cannot be empty)."""


def topic_stream(topic: str) -> str:
    return f"TOPIC_{topic}"


def topic_subject(topic: str, tag: str | None = None) -> str:
    """Committed messages of `topic` are published on `topic.<topic>.<tag>`."""
    return f"topic.{topic}.{tag or NO_TAG}"


def topic_filter(topic: str) -> str:
    return f"topic.{topic}.>"


def dlq_stream(group: str) -> str:
    return f"DLQ_{group}"


def dlq_subject(group: str, topic: str) -> str:
    return f"dlq.{group}.{topic}"


def dlq_filter(group: str) -> str:
    return f"dlq.{group}.>"


# -- headers --------------------------------------------------------------------------------

CONTENT_TYPE_HEADER: Final = "Content-Type"
"""A command's or a committed message's encoding when it is not msgpack (`protocol.Encoding`)."""
MSG_ID_HEADER: Final = "Nats-Msg-Id"
"""JetStream de-duplication: `<txid>:<index>` on every committed message."""
EXPECTED_LAST_SUBJECT_SEQ_HEADER: Final = "Nats-Expected-Last-Subject-Sequence"
"""Fences OP appends: a coordinator that lost its partition cannot write behind the new one."""

TXID_HEADER: Final = "Txn-Id"
GROUP_HEADER: Final = "Txn-Group"
PRODUCER_HEADER: Final = "Txn-Producer"
TOPIC_HEADER: Final = "Txn-Topic"
INDEX_HEADER: Final = "Txn-Index"
TAG_HEADER: Final = "Txn-Tag"
KEYS_HEADER: Final = "Txn-Keys"
"""Message keys, comma separated (keys may not contain commas)."""
BORN_HEADER: Final = "Txn-Born"
"""Seconds since the epoch when the coordinator stored the half."""
IMMUNITY_HEADER: Final = "Txn-Check-Immunity"
TOKEN_HEADER: Final = "Txn-Token"
BEGINS_HEADER: Final = "Txn-Begins"
PACK_HEADER: Final = "Txn-Pack"
"""On a TXN_HALF message holding a pack of halves (`coordinator/partition/packs.py`): the
pack format's version, `1`. A half stored alone, with its fields as headers, has none."""
COMMITTED_AT_HEADER: Final = "Txn-Committed-At"
CHECK_TIMES_HEADER: Final = "Txn-Check-Times"
DISCARD_REASON_HEADER: Final = "Txn-Discard-Reason"
ORIGIN_STREAM_HEADER: Final = "Txn-Origin-Stream"
ORIGIN_SEQ_HEADER: Final = "Txn-Origin-Seq"
"""Where the original is: a dead letter's topic stream and sequence, or a quarantined record's."""
DLQ_OMITTED_HEADER: Final = "Txn-Omitted"
"""On a dead letter by reference: what it leaves out (`body`, or `body,headers`)."""
QUARANTINE_REASON_HEADER: Final = "Txn-Quarantine-Reason"
"""On a quarantined copy: why the record was refused or could not be read."""
ORIGIN_SUBJECT_HEADER: Final = "Txn-Origin-Subject"
"""On a quarantined copy: the subject the record was (or was to be) written to; a record read
back from a stream also gets ORIGIN_STREAM_HEADER and ORIGIN_SEQ_HEADER."""
BODY_DROPPED_HEADER: Final = "Txn-Body-Dropped"
"""On a quarantined copy too large to keep whole: the size of the body left out."""
ERROR_HEADER: Final = "Txn-Error"
"""On a dead-lettered message: the last error the consumer's handler raised."""
DELIVERIES_HEADER: Final = "Txn-Deliveries"
REPLAY_GROUP_HEADER: Final = "Txn-Replay-Group"
"""On a dead letter replayed to its topic (`txactors dlq replay`): the one group meant to
handle it; every other group's consumer acks it unhandled (it had the original)."""
REPLAY_OF_HEADER: Final = "Txn-Replay-Of"
"""On a replayed dead letter: the `Nats-Msg-Id` of the message first delivered."""

RESERVED_HEADER_PREFIXES: Final = ("Nats-", "Txn-")
"""User properties travel as headers and may not use these prefixes (in any case)."""
RESERVED_HEADER_NAMES: Final = frozenset({"status", "description", "kv-operation"})
"""Lower-cased names NATS clients read as control headers: `Status`/`Description` make a
message look like a server status (no responders, heartbeat), `KV-Operation` a KV delete."""


def is_reserved_header(name: str) -> bool:
    """True for a header name txactors or NATS owns, however it is spelled: a client in
    another language canonicalises case, and nats-py strips blanks before sending."""
    folded = name.strip().lower()
    return folded in RESERVED_HEADER_NAMES or folded.startswith(
        tuple(p.lower() for p in RESERVED_HEADER_PREFIXES)
    )


def message_id(txid: str, index: int) -> str:
    """A committed message's `Nats-Msg-Id`, `<txid>:<index>`: a re-publish is dropped."""
    return f"{txid}:{index}"


_HALF_ID_SUFFIX: Final = ":half"


def half_message_id(txid: str, index: int) -> str:
    """A half stored alone's `Nats-Msg-Id`, `<txid>:<index>:half`: apart from its committed
    copy's."""
    return f"{message_id(txid, index)}{_HALF_ID_SUFFIX}"


def half_of_message_id(msg_id: str) -> tuple[str, int]:
    """(txid, index) of a `half_message_id`; ValueError if `msg_id` is not one."""
    if not msg_id.endswith(_HALF_ID_SUFFIX):
        raise ValueError(f"{MSG_ID_HEADER} {shown(msg_id)} is not a half's")
    txid, _, index = msg_id.removesuffix(_HALF_ID_SUFFIX).rpartition(":")
    if not txid:
        raise ValueError(f"{MSG_ID_HEADER} {shown(msg_id)} names no txid")
    return txid, int(index)


def pack_message_id(unique: str) -> str:
    """A pack's `Nats-Msg-Id`, `<unique>:pack`: one per pack, the same when a write is
    retried."""
    return f"{unique}:pack"


def discarded_message_id(txid: str, index: int) -> str:
    """A discarded half's copy's `Nats-Msg-Id` in TXN_DISCARD, `<txid>:<index>:discard`."""
    return f"{message_id(txid, index)}:discard"


def partition_of(txid: str, partitions: int) -> int:
    """hash(txid) mod P, with a hash that every language computes alike (CRC-32)."""
    return zlib.crc32(txid.encode()) % partitions
