"""Whether a JetStream failure passes, and trying again while it does: one rule for everyone.

The coordinator's writes and reads, stream declarations at start-up (`topics.declaring`) and
consumers waiting for their streams all ask `transient`, and retry with `retry_transient`:
a cluster electing a leader, a server restarting or a connection dropping is waited out with
capped, jittered backoff; an answer JetStream will give the same way every time is not.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

import anyio
import nats.errors
import nats.js.errors

from txactors.errors import TxActorsError
from txactors.observe.logs import get_logger

log = get_logger(__name__)

T = TypeVar("T")

RETRY_INITIAL: Final = 0.05
RETRY_MAX: Final = 2.0
FIRST_ATTEMPT: Final = 1.0
"""Seconds the first attempt of a retried call may take. A request sent while the stream (or
the meta layer) has no leader is never answered: waiting out the JetStream API timeout (5 s)
would hold a recovery, a commit or a start-up that long after the election. Later attempts
get twice as long each, so a slow but healthy server is waited for too."""

PLACEMENT_CODES: Final = frozenset({10005, 10023})
""""no suitable peers for placement", "insufficient resources": too few peers for the replicas,
which lasts only while peers are joining (unless the cluster is too small for good)."""
_UNAVAILABLE_CODES: Final = frozenset({10008, 10009, 10118, 10119, 10195, 10202})
"""Answers that pass once a cluster has elected: temporarily unavailable, not the leader,
stream or consumer offline, member change in progress."""
CLUSTER_TRANSIENT_CODES: Final = _UNAVAILABLE_CODES | PLACEMENT_CODES
"""Every JetStream answer that passes while a cluster forms, elects or changes members,
whatever its HTTP-like code."""
IN_PROCESS_CODE: Final = 10158
""""duplicate message id is in process" (409): a write with this `Nats-Msg-Id`, ours (its
retry went out before the first attempt's answer), is still being stored. Asked again once
it is, the write is answered as the duplicate it is: a retry of ourselves, never a refusal."""

LINK_TROUBLE = (nats.errors.Error, TimeoutError, OSError)
"""What a NATS or JetStream call raises when the broker, not our code, is the problem."""


class LinkLost(TxActorsError):
    """The connection dropped while a JetStream call was waiting for its answer."""


def api_error_code(error: BaseException) -> int | None:
    """JetStream's `err_code` of an APIError, None for anything else. nats-py raises some
    APIErrors (KeyNotFoundError, KeyDeletedError) without one, so never read it directly."""
    if not isinstance(error, nats.js.errors.APIError):
        return None
    code: int | None = getattr(error, "err_code", None)
    return code


class Fault(enum.Enum):
    TRANSIENT = "transient"
    PERMANENT = "permanent"


def classify(error: BaseException) -> Fault:
    """Whether trying the same call again can succeed.

    Timeouts, lost connections, "no responders" (JetStream restarting or electing a leader),
    503/500 answers, `CLUSTER_TRANSIENT_CODES` and `IN_PROCESS_CODE` pass; anything else
    JetStream answers (too large, wrong expected sequence, not found, stream sealed or
    misconfigured) will be answered the same way every time. A stream that is really gone
    answers "no responders" too: `PipelinedWriter` tells it apart by asking JetStream which
    stream holds the subject.
    """
    if isinstance(error, nats.js.errors.ServiceUnavailableError | nats.js.errors.ServerError):
        return Fault.TRANSIENT
    code = api_error_code(error)
    if code in CLUSTER_TRANSIENT_CODES or code == IN_PROCESS_CODE:
        return Fault.TRANSIENT
    if isinstance(error, nats.js.errors.APIError | nats.errors.MaxPayloadError):
        return Fault.PERMANENT
    return Fault.TRANSIENT


def transient(error: BaseException) -> bool:
    """A broker failure worth trying again (`LINK_TROUBLE`, `LinkLost`, not `PERMANENT`)."""
    return isinstance(error, (*LINK_TROUBLE, LinkLost)) and classify(error) is Fault.TRANSIENT


def backoff(delay: float) -> float:
    """The wait after `delay`: doubled up to `RETRY_MAX`, with up to a fifth of jitter so
    the partitions of a coordinator (or the processes of a deployment) do not all come back
    to a recovering server at once."""
    return min(delay * 2, RETRY_MAX) * (1 - random.random() / 5)


async def retry_transient(
    fn: Callable[..., Awaitable[T]],
    *args: Any,
    what: str = "",
    deadline: float = math.inf,
    event: str = "jetstream_retry",
) -> T:
    """`await fn(*args)`, tried again with capped, jittered backoff while it fails
    transiently (`transient`) and `deadline` seconds have not passed; each retry is logged as
    `event`. The first attempt may take `FIRST_ATTEMPT` seconds, each next one twice as long.
    `deadline=0`: one attempt, as the caller's JetStream context times it, its error as
    raised."""
    give_up = anyio.current_time() + deadline
    delay = RETRY_INITIAL
    limit = FIRST_ATTEMPT if deadline > 0 else math.inf
    attempt = 1
    while True:
        try:
            with anyio.fail_after(limit):
                return await fn(*args)
        except (*LINK_TROUBLE, LinkLost) as error:
            if not transient(error) or anyio.current_time() + delay > give_up:
                raise
            name = what or getattr(fn, "__name__", type(fn).__name__)
            log.warning(event, call=name, attempt=attempt, error=describe(error), delay=delay)
        await anyio.sleep(delay)
        delay = backoff(delay)
        limit *= 2
        attempt += 1


def describe(error: BaseException) -> str:
    """One line naming the error, for logs and the quarantine header."""
    if isinstance(error, nats.js.errors.APIError):
        code = getattr(error, "code", None)
        description = getattr(error, "description", None) or error
        return f"{type(error).__name__} {code}/{api_error_code(error)}: {description}"
    return f"{type(error).__name__}: {error}".rstrip(": ")
