"""Actors across processes: serve a local actor (or a pool) on a NATS subject, reach it
with a ref.

The serving side decodes at the boundary (bad input is answered with an `Error` and never
reaches the actor), answers only inbox reply subjects (`ReplyGuard`: a request whose reply
subject is anything else is not executed at all), and only enqueues a `Request` whose sink
publishes to the reply subject; the actor answers it, now or later, exactly as it answers a
local ask. Nothing waits per request in the subscription callback, so requests pipeline
through the mailbox and a full mailbox (or a pool with no idle member) slows the
subscription down (backpressure) instead of dropping work. On a `TolerantClient` a
well-formed request for a local actor with room in its mailbox is enqueued in the client's
read loop (`subscribe_direct`), a loop turn sooner; the rest take the callback's way.
"""

from __future__ import annotations

from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from txactors.actors.envelope import NO_REPLY, Request, unwrap
from txactors.actors.ref import DEFAULT_ASK_TIMEOUT, LocalActorRef, Mailbox
from txactors.actors.replies import ReplyGuard
from txactors.errors import ActorDeadError, AskTimeout, CommandError, NotHandled
from txactors.nats.client import TolerantClient, malformed_headers
from txactors.observe.logs import get_logger
from txactors.wire.protocol import (
    Codec,
    Encoding,
    Error,
    ErrorCode,
    encode,
    encoding_of,
    headers_for,
)

log = get_logger(__name__)

REPLY_HEADROOM = 512
"""Bytes of `max_payload` kept for the reply's headers and subject."""
NOT_HANDLED_RETRY_AFTER = 0.5
"""Seconds a caller whose request was still queued when its actor stopped waits before it
sends it again (`NotHandled`): a partition handed over is served again within about that."""


class NatsReply:
    """The sink of a served ask: publishes the answer to the requester's reply subject."""

    __slots__ = ("_encoding", "_nc", "_subject")

    def __init__(self, nc: Client, subject: str, encoding: Encoding) -> None:
        self._nc = nc
        self._subject = subject
        self._encoding = encoding

    async def resolve(self, value: Any) -> None:
        try:
            payload = encode(value, self._encoding)
        except (TypeError, ValueError) as error:  # msgspec.EncodeError is a ValueError
            log.error("reply_not_encodable", reply_type=type(value).__name__, error=str(error))
            payload = encode(
                Error(ErrorCode.INTERNAL, f"the reply could not be encoded: {error}"),
                self._encoding,
            )
        room = self._nc.max_payload - REPLY_HEADROOM
        if len(payload) > room:
            # NATS would refuse it and the requester would only see a timeout.
            log.warning("reply_too_large", reply_type=type(value).__name__, size=len(payload))
            payload = encode(
                Error(
                    ErrorCode.BAD_REQUEST,
                    f"the answer is {len(payload)} bytes, over the {room} a reply may carry "
                    "here; ask for less (e.g. a `limit` or a filter)",
                ),
                self._encoding,
            )
        await self._publish(payload)

    async def fail(self, error: BaseException) -> None:
        await self._publish(encode(error_reply(error), self._encoding))

    async def _publish(self, payload: bytes) -> None:
        try:
            await self._nc.publish(self._subject, payload, headers=headers_for(self._encoding))
        except Exception as error:  # the requester is gone or the connection closed
            log.warning("reply_not_sent", subject=self._subject, error=repr(error))


def error_reply(error: BaseException) -> Error:
    """The wire form of a failure; internals are named, not dumped."""
    if isinstance(error, CommandError):
        return Error(error.code, error.message, error.retry_after)
    if isinstance(error, NotHandled):  # nothing was done: come back (to its successor)
        return Error(ErrorCode.INTERNAL, f"{error}; send it again", NOT_HANDLED_RETRY_AFTER)
    if isinstance(error, ActorDeadError):
        return Error(ErrorCode.INTERNAL, str(error))
    return Error(ErrorCode.INTERNAL, f"{type(error).__name__}: {error}")


async def serve(
    nc: Client,
    ref: Mailbox,
    subject: str,
    message_type: Any,
    *,
    queue: str = "",
    replies: ReplyGuard | None = None,
    tells: bool = True,
) -> Subscription:
    """Serve `ref` (an actor or an `ActorPool`) on `subject`, accepting the Structs of
    `message_type` (a union).

    With `queue`, several processes serve the same subject and NATS spreads requests
    across them. `replies` says which reply subjects are answered (default: under
    `_INBOX.`); a request with any other reply subject is dropped before it reaches the
    actor. With `tells=False` a message without a reply subject is refused the same way
    (an endpoint whose work is pointless when nobody waits for the answer).
    Unsubscribe (or drain) the returned subscription to stop serving.
    """
    codec: Codec[Any] = Codec(message_type)
    guard = replies or ReplyGuard()

    async def answer(msg: Msg, error: Error, encoding: Encoding) -> None:
        if msg.reply and guard.refusal(msg.reply, msg.subject) is None:
            await NatsReply(nc, msg.reply, encoding).resolve(error)

    dispatching = False
    subscription: Subscription | None = None

    async def on_request(msg: Msg) -> None:
        nonlocal dispatching
        dispatching = True
        try:
            await dispatch(msg)
        except Exception as error:  # a bug here must not kill the subscription
            log.exception("request_dispatch_failed", subject=subject)
            await answer(msg, error_reply(error), Encoding.MSGPACK)
        finally:
            dispatching = False

    def at_once(msg: Msg) -> bool:
        """A well-formed request for a local actor with room in its mailbox, enqueued in the
        client's read loop (a loop turn sooner); anything else (to refuse or answer, a full
        mailbox, requests queued before it) is left to `on_request`, in order."""
        if dispatching or subscription is None or not subscription._pending_queue.empty():
            return False
        assert isinstance(ref, LocalActorRef)
        try:
            if (msg.reply or not tells) and guard.refusal(msg.reply, msg.subject) is not None:
                return False  # counted and logged there
            if malformed_headers(msg) is not None:
                return False
            encoding = encoding_of(msg.headers)
            if isinstance(encoding, Error):
                return False
            message = codec.decode(msg.data, encoding)
            if isinstance(message, Error):
                return False
            sink = NatsReply(nc, msg.reply, encoding) if msg.reply else NO_REPLY
            ref.post_nowait(Request(message, sink, msg.subject))
        except Exception:  # a full mailbox, a stopped actor, a bug: `on_request`'s to handle
            return False
        return True

    async def dispatch(msg: Msg) -> None:
        if (msg.reply or not tells) and not guard.allows(msg.reply, subject, msg.subject):
            return
        unreadable = malformed_headers(msg)
        if unreadable is not None:
            log.info(
                "request_rejected", subject=subject, code=ErrorCode.BAD_REQUEST, reason=unreadable
            )
            problem = f"the header block could not be parsed ({unreadable})"
            await answer(msg, Error(ErrorCode.BAD_REQUEST, problem), Encoding.MSGPACK)
            return
        encoding = encoding_of(msg.headers)
        if isinstance(encoding, Error):
            await answer(msg, encoding, Encoding.MSGPACK)
            return
        message = codec.decode(msg.data, encoding)
        if isinstance(message, Error):
            log.info("request_rejected", subject=subject, code=message.code, reason=message.message)
            await answer(msg, message, encoding)
            return
        sink = NatsReply(nc, msg.reply, encoding) if msg.reply else NO_REPLY
        try:
            await ref.post(Request(message, sink, msg.subject))
        except ActorDeadError as error:
            await answer(msg, error_reply(error), encoding)

    if isinstance(nc, TolerantClient) and isinstance(ref, LocalActorRef):
        subscription = await nc.subscribe_direct(subject, at_once, on_request, queue=queue)
    else:
        subscription = await nc.subscribe(subject, queue=queue, cb=on_request)
    return subscription


class RemoteActorRef:
    """An `ActorRef` for an actor served on `subject`, possibly in another process.

    `reply_type` is the Struct (or union) the actor answers with; replies are decoded
    against it, and an `Error` reply raises `CommandError` as a local ask would.
    """

    def __init__(
        self,
        nc: Client,
        subject: str,
        reply_type: Any,
        *,
        encoding: Encoding = Encoding.MSGPACK,
    ) -> None:
        self.name = subject
        self._nc = nc
        self._subject = subject
        self._encoding = encoding
        self._headers = headers_for(encoding)
        self._replies: Codec[Any] = Codec(reply_type | Error)

    def __repr__(self) -> str:
        return f"<RemoteActorRef {self._subject}>"

    async def tell(self, message: Any) -> None:
        await self._nc.publish(
            self._subject, encode(message, self._encoding), headers=self._headers
        )

    async def ask(self, message: Any, timeout: float = DEFAULT_ASK_TIMEOUT) -> Any:
        payload = encode(message, self._encoding)
        try:
            msg = await self._nc.request(self._subject, payload, timeout, headers=self._headers)
        except nats.errors.NoRespondersError:
            raise ActorDeadError(f"no actor is serving {self._subject!r}") from None
        except nats.errors.TimeoutError:
            raise AskTimeout(f"{self._subject} did not answer within {timeout}s") from None
        encoding = encoding_of(msg.headers)
        if isinstance(encoding, Error):
            raise CommandError(encoding.code, f"unreadable reply: {encoding.message}")
        return unwrap(self._replies.decode(msg.data, encoding))
