"""Declaring the streams that hold committed messages, shared by the coordinator and consumers.

Either side may run first: a consumer group can subscribe before anything was ever committed,
and the coordinator publishes to topics no consumer has seen. So both call
`ensure_topic_stream`, which creates the stream or widens an existing one, and is safe to call
from many processes at once. It never narrows what someone else declared (a shorter duplicate
window, fewer subjects, fewer replicas), because another role may depend on it. A consumer
group's dead-letter stream is declared the same way by both (`ensure_dlq_stream`: the group's
consumer, and a coordinator told the group's topics).

Every stream txactors declares (topics, dead-letter queues, the coordinator's TXN_* streams)
goes through `declare_stream`, every KV bucket through `ensure_bucket`. Declarations happen at
start-up, which on a cluster may be while it forms or elects: JetStream then answers
"temporarily unavailable", "no suitable peers for placement" or nothing at all. `declaring`
retries those with backoff up to a deadline instead of failing the process (`retry.transient`
says which answers pass).

A client without the right to create streams (a consumer under least privilege) uses
`wait_for_stream` instead: it only reads the stream's info, until the coordinator made it.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, TypeVar

import anyio
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType, StreamConfig
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from txactors.errors import ConfigError
from txactors.nats.retry import PLACEMENT_CODES, api_error_code, retry_transient, transient
from txactors.observe.logs import RateLimited, get_logger
from txactors.wire.layout import (
    bucket_stream,
    dlq_filter,
    dlq_stream,
    topic_filter,
    topic_stream,
    validate_name,
)

log = get_logger(__name__)

_NAMES_TIMEOUT: Final = 5.0
"""Seconds one page of `$JS.API.STREAM.NAMES` may take."""

DEFAULT_DUPLICATE_WINDOW: Final = 600.0
"""Seconds JetStream remembers a `Nats-Msg-Id`: a commit replayed by a coordinator that
restarted within this window is dropped by the server; a later replay is caught by the
consumer's idempotent helper. The coordinator passes its own recovery horizon."""

STREAM_NAME_IN_USE: Final = 10058
"""JetStream's answer to creating a stream that exists with another configuration."""
_REPLICAS_NOT_SUPPORTED: Final = 10074
"""JetStream's answer to replicas > 1 on a server that is not part of a cluster."""

DECLARE_DEADLINE: Final = 60.0
"""Seconds a start-up declaration keeps retrying what a forming cluster answers. A cluster's
servers started together elect within a second or two, but an orchestrator starts them one
by one, and a fresh cluster elects its first meta leader only once every configured peer is
up; a minute covers a rolling start without hiding a cluster that never forms."""
_WAIT_FIRST: Final = 0.1
WAIT_POLL_MAX: Final = 5.0
"""Seconds between two looks at a stream awaited by `wait_for_stream`, at most."""

T = TypeVar("T")


def replicas_error(what: str, replicas: int, error: APIError) -> ConfigError:
    """The error for a replica count the server cannot give, naming the setting to change."""
    return ConfigError(
        f"{what} needs {replicas} replicas but JetStream says: {error.description}; "
        "lower the `replicas` setting (`--replicas` of `txactors coordinator`, "
        "`replicas=` of CoordinatorOptions or Consumer) or run a cluster with enough servers"
    )


def is_replicas_error(error: APIError) -> bool:
    return api_error_code(error) == _REPLICAS_NOT_SUPPORTED


def is_placement_error(error: BaseException) -> bool:
    """Too few peers for the replicas asked: transient while peers join, else a ConfigError."""
    return api_error_code(error) in PLACEMENT_CODES


async def declaring(
    what: str, declare: Callable[[], Awaitable[T]], *, deadline: float, replicas: int = 1
) -> T:
    """`await declare()`, retried while JetStream's answer is transient and `deadline`
    seconds have not passed (`retry.retry_transient`, each retry logged as `declare_retry`).
    Too few peers for `replicas` at the deadline is a ConfigError; other errors stand as
    raised. `deadline=0`: one attempt, its error as raised (the caller tells transient from
    permanent itself)."""
    try:
        return await retry_transient(declare, what=what, deadline=deadline, event="declare_retry")
    except APIError as error:
        if is_placement_error(error) and deadline > 0:
            raise replicas_error(what, replicas, error) from error
        raise


async def wait_for_stream(js: JetStreamContext, name: str) -> str:
    """Return `name` once stream `name` exists, looking at its info only (never creating it):
    with backoff up to WAIT_POLL_MAX seconds, logging `stream_awaited` at first and then
    every `logs.LOG_EVERY` seconds. A transient answer (a cluster electing) is waited out."""
    delay = _WAIT_FIRST
    awaited = False
    logged = RateLimited(clock=anyio.current_time)
    while True:
        try:
            await js.stream_info(name)
            if awaited:
                log.info("stream_appeared", stream=name)
            return name
        except NotFoundError:
            problem = "it does not exist yet (the coordinator creates it)"
        except Exception as error:
            if not transient(error):
                raise
            problem = f"JetStream does not answer now: {error!r}"
        awaited = True
        if logged.suppressed(name) is not None:
            log.warning("stream_awaited", stream=name, problem=problem)
        await anyio.sleep(delay)
        delay = min(delay * 2, WAIT_POLL_MAX)


async def ensure_stream(
    js: JetStreamContext,
    name: str,
    subjects: Sequence[str],
    *,
    duplicate_window: float = DEFAULT_DUPLICATE_WINDOW,
    storage: StorageType = StorageType.FILE,
    replicas: int = 1,
    allow_atomic: bool = False,
    deadline: float = DECLARE_DEADLINE,
) -> None:
    """`declare_stream` of stream `name` on `subjects`, with only what txactors sets."""
    config = StreamConfig(
        name=name,
        subjects=list(subjects),
        storage=storage,
        duplicate_window=duplicate_window,
        num_replicas=replicas,
        allow_atomic=allow_atomic or None,
    )
    await declare_stream(js, config, deadline=deadline)


async def declare_stream(
    js: JetStreamContext, config: StreamConfig, *, deadline: float = DECLARE_DEADLINE
) -> None:
    """Create stream `config.name` as `config`, or widen an existing one to also cover its
    subjects, duplicate window and replicas, and to take atomic batches if `config` does;
    whatever else an existing stream has (an operator's tuning, an older version's limits) it
    keeps. Transient answers are retried for `deadline` seconds (`declaring`).

    Raises ConfigError when the stream exists with another storage type, which JetStream
    cannot change in place, or when the server cannot hold the replicas asked for.
    """
    replicas = config.num_replicas or 1
    await declaring(
        f"stream {config.name}",
        lambda: _ensure_stream(js, config),
        deadline=deadline,
        replicas=replicas,
    )


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    name = config.name or ""
    storage = config.storage or StorageType.FILE
    replicas = config.num_replicas or 1
    subjects = list(config.subjects or ())
    duplicate_window = config.duplicate_window or 0.0
    allow_atomic = bool(config.allow_atomic)
    for _ in range(3):  # lost a create race → read what the winner made, then widen it
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            try:
                await js.add_stream(config)
                return
            except APIError as exc:
                if is_replicas_error(exc):
                    raise replicas_error(f"stream {name}", replicas, exc) from exc
                if api_error_code(exc) != STREAM_NAME_IN_USE:  # "no suitable peers" is a 400 too
                    raise
                continue
        current = info.config
        # nats-py leaves the enum as the server's plain string in a stream_info answer
        have_storage = StorageType(current.storage or storage)
        if have_storage != storage:
            raise ConfigError(
                f"stream {name} exists with {have_storage.value} storage, but txactors "
                f"needs {storage.value}; move its messages elsewhere and delete it "
                f"(nats stream rm {name}) so it can be recreated"
            )
        have = list(current.subjects or [])
        missing = [s for s in subjects if s not in have]
        window = current.duplicate_window or 0.0
        have_replicas = current.num_replicas or 1
        atomic = bool(current.allow_atomic)
        if (
            missing
            or window < duplicate_window
            or have_replicas < replicas
            or atomic < allow_atomic
        ):
            current.subjects = have + missing
            current.duplicate_window = max(window, duplicate_window)
            current.num_replicas = max(have_replicas, replicas)
            current.allow_atomic = atomic or allow_atomic or None
            try:
                await js.update_stream(current)
            except APIError as exc:
                if is_replicas_error(exc):
                    raise replicas_error(f"stream {name}", replicas, exc) from exc
                raise
        return
    raise ConfigError(f"stream {name} kept appearing and disappearing while declaring it")


async def ensure_replicas(js: JetStreamContext, name: str, replicas: int) -> None:
    """Raise stream `name` (a KV bucket's: `bucket_stream`) to at least `replicas` copies."""
    current = (await js.stream_info(name)).config
    if (current.num_replicas or 1) >= replicas:
        return
    current.num_replicas = replicas
    try:
        await js.update_stream(current)
    except APIError as exc:
        if is_replicas_error(exc):
            raise replicas_error(f"stream {name}", replicas, exc) from exc
        raise


async def ensure_bucket(
    js: JetStreamContext, config: KeyValueConfig, *, deadline: float = DECLARE_DEADLINE
) -> KeyValue:
    """Open KV bucket `config.bucket`, creating it if absent; it gets `config.replicas` copies
    at least (an existing bucket keeps an operator's other settings). Transient answers are
    retried for `deadline` seconds (`declaring`)."""
    return await declaring(
        f"KV bucket {config.bucket}",
        lambda: _ensure_bucket(js, config),
        deadline=deadline,
        replicas=config.replicas,
    )


async def _ensure_bucket(js: JetStreamContext, config: KeyValueConfig) -> KeyValue:
    try:
        kv = await js.key_value(config.bucket)
    except BucketNotFoundError:
        try:
            return await js.create_key_value(config)
        except APIError as error:
            if is_replicas_error(error):
                raise replicas_error(
                    f"KV bucket {config.bucket}", config.replicas, error
                ) from error
            raise
    await ensure_replicas(js, bucket_stream(config.bucket), config.replicas)
    return kv


async def ensure_topic_stream(
    js: JetStreamContext,
    topic: str,
    *,
    duplicate_window: float = DEFAULT_DUPLICATE_WINDOW,
    replicas: int = 1,
    deadline: float = DECLARE_DEADLINE,
) -> str:
    """Declare `TOPIC_<topic>` on `topic.<topic>.>` (file storage, `replicas` copies, atomic
    batches allowed so the coordinator can write a commit's messages in one write); returns
    the stream name. Transient answers are retried for `deadline` seconds."""
    name = topic_stream(validate_name("topic", topic))
    await ensure_stream(
        js,
        name,
        [topic_filter(topic)],
        duplicate_window=duplicate_window,
        replicas=replicas,
        allow_atomic=True,
        deadline=deadline,
    )
    return name


async def topic_stream_count(nc: Client, prefix: str) -> int:
    """How many topic streams exist whose topic starts with `prefix` (every page of
    `$JS.API.STREAM.NAMES`, filtered here: JetStream filters by subject, not by prefix)."""
    wanted = topic_stream(prefix)
    count, offset = 0, 0
    while True:
        request = json.dumps({"offset": offset}).encode()
        reply = await nc.request("$JS.API.STREAM.NAMES", request, _NAMES_TIMEOUT)
        answer = json.loads(reply.data)
        if "error" in answer:
            APIError.from_error(answer["error"])  # raises it
        names = answer.get("streams") or []
        count += sum(1 for name in names if name.startswith(wanted))
        offset += len(names)
        if not names or offset >= answer.get("total", 0):
            return count


async def ensure_dlq_stream(
    js: JetStreamContext, group: str, *, replicas: int = 1, deadline: float = DECLARE_DEADLINE
) -> str:
    """Declare `DLQ_<group>` on `dlq.<group>.>` (file storage, `replicas` copies); returns
    the stream name. Transient answers are retried for `deadline` seconds."""
    name = dlq_stream(validate_name("group", group))
    await ensure_stream(js, name, [dlq_filter(group)], replicas=replicas, deadline=deadline)
    return name
