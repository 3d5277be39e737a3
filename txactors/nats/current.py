"""Whether a stream is current: it has a leader and its replicas have caught up.

After a whole cluster restarts, each node rebuilds its copy of a stream from its raft log
before it has the stream's latest messages; a read served meanwhile (an ephemeral consumer
placed on such a node, say) sees fewer messages than were acknowledged. Recovery decides
from what it reads which transactions are open, so it waits (`wait_current`) until the
stream's info names a leader and no reachable replica is behind (a server that died does
not count: that is what replicas are for; the rule is `wire.replicas.why_not_current`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

import anyio
from nats.js import JetStreamContext

from txactors.nats.retry import (
    FIRST_ATTEMPT,
    LINK_TROUBLE,
    RETRY_INITIAL,
    backoff,
    describe,
    transient,
)
from txactors.observe.logs import get_logger
from txactors.wire.replicas import why_not_current

CURRENT_DEADLINE: Final = 60.0
"""Seconds recovery waits for a stream to be current before it reads anyway (and says so):
a whole cluster restarted elects and catches up in 5-15 s; a replica that never catches up
(a node down for good) must not keep the partition from serving. What a read then misses
is found later by the partition's `LateHalves`."""

log = get_logger(__name__)


async def wait_current(
    js: JetStreamContext,
    stream: str,
    *,
    deadline: float = CURRENT_DEADLINE,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """Wait until `stream` is current; False if it was not within `deadline` seconds (the
    caller reads anyway). A stream without a leader answers no info request: each is given
    `FIRST_ATTEMPT` seconds and retried with backoff, as are other transient failures; a
    permanent one is raised."""
    started = clock()
    delay = RETRY_INITIAL
    told: str | None = None
    while True:
        try:
            with anyio.fail_after(FIRST_ATTEMPT):  # unanswered while there is no leader
                info = await js.stream_info(stream)
            why = why_not_current(f"stream {stream}", info.cluster)
        except LINK_TROUBLE as error:
            if not transient(error):
                raise
            why = f"stream {stream} does not answer: {describe(error)}"
        waited = round(clock() - started, 3)
        if why is None:
            if told is not None:
                log.info("stream_current", stream=stream, waited=waited)
            return True
        if waited >= deadline:
            log.warning("stream_not_current_read_anyway", stream=stream, why=why, waited=waited)
            return False
        if why != told:
            log.info("stream_not_current_yet", stream=stream, why=why, waited=waited)
            told = why
        await anyio.sleep(delay)
        delay = backoff(delay)
