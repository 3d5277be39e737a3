"""Declaring the streams that hold committed messages, shared by the coordinator and consumers.

Either side may run first: a consumer group can subscribe before anything was ever committed,
and the coordinator publishes to topics no consumer has seen. So both call
`ensure_topic_stream`, which creates the stream or widens an existing one, and is safe to call
from many processes at once. It never narrows what someone else declared (a shorter duplicate
window, fewer subjects), because another role may depend on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from nats.js import JetStreamContext
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

from txactors.errors import ConfigError
from txactors.layout import topic_filter, topic_stream, validate_name

DEFAULT_DUPLICATE_WINDOW: Final = 600.0
"""Seconds JetStream remembers a `Nats-Msg-Id`: a commit replayed by a coordinator that
restarted within this window is dropped by the server; a later replay is caught by the
consumer's idempotent helper. The coordinator passes its own recovery horizon."""

_STREAM_NAME_IN_USE: Final = 10058


async def ensure_stream(
    js: JetStreamContext,
    name: str,
    subjects: Sequence[str],
    *,
    duplicate_window: float = DEFAULT_DUPLICATE_WINDOW,
    storage: StorageType = StorageType.FILE,
) -> None:
    """Create stream `name`, or update it to also cover `subjects` and `duplicate_window`.

    Raises ConfigError when the stream exists with another storage type, which JetStream
    cannot change in place.
    """
    for _ in range(3):  # lost a create race → read what the winner made, then widen it
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            config = StreamConfig(
                name=name,
                subjects=list(subjects),
                storage=storage,
                duplicate_window=duplicate_window,
            )
            try:
                await js.add_stream(config)
                return
            except BadRequestError as exc:
                if exc.err_code != _STREAM_NAME_IN_USE:
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
        if missing or window < duplicate_window:
            current.subjects = have + missing
            current.duplicate_window = max(window, duplicate_window)
            await js.update_stream(current)
        return
    raise ConfigError(f"stream {name} kept appearing and disappearing while declaring it")


async def ensure_topic_stream(
    js: JetStreamContext, topic: str, *, duplicate_window: float = DEFAULT_DUPLICATE_WINDOW
) -> str:
    """Declare `TOPIC_<topic>` on `topic.<topic>.>` (file storage); returns the stream name."""
    name = topic_stream(validate_name("topic", topic))
    await ensure_stream(js, name, [topic_filter(topic)], duplicate_window=duplicate_window)
    return name
