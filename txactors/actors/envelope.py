"""What travels through a mailbox: a `Request`, the message and the one way to answer it.

Every message an actor gets arrives as a Request; its reply sink hides whether the asker is
in this process (an event it waits on, `LocalReply`) or behind NATS (a subject to publish
to, `remote.NatsReply`), so answering now or later is the same call for both. A tell has no
sink: answering it answers nobody.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import anyio

from txactors.errors import CommandError
from txactors.wire.protocol import Error


class ReplySink(Protocol):
    async def resolve(self, value: Any) -> None: ...

    async def fail(self, error: BaseException) -> None: ...


class Request:
    """A message and its reply handle, settled once by `answer` or `fail`.

    The runtime answers with `receive`'s return value, through this same handle, unless the
    actor answers later (`Actor.answers_later`): then `receive` gets the handle itself and
    the actor keeps it until it knows the answer. The first settlement wins; later ones do
    nothing, so an answer racing a failure cannot reach the asker twice.
    """

    __slots__ = ("_on_settled", "_settled", "message", "reply", "subject")

    def __init__(
        self, message: Any, reply: ReplySink | None = None, subject: str | None = None
    ) -> None:
        self.message = message
        self.reply = reply
        self.subject = subject
        """The NATS subject it arrived on (None: sent in this process); a subject may carry
        who is allowed to send it (a producer group)."""
        self._settled = False
        self._on_settled: Callable[[], None] | None = None

    def __repr__(self) -> str:
        return f"<Request {type(self.message).__name__}>"

    def on_settled(self, callback: Callable[[], None]) -> None:
        """Call `callback` once this request is answered or failed (a pool frees its member)."""
        self._on_settled = callback

    async def answer(self, value: Any) -> None:
        """Send `value` (a protocol `Error` answers with an error code) to the asker, if any."""
        if self.settle() and self.reply is not None:
            await self.reply.resolve(value)

    async def fail(self, error: BaseException) -> None:
        """Hand `error` to the asker: raised by a local ask, an `Error` reply on the wire."""
        if self.settle() and self.reply is not None:
            await self.reply.fail(error)

    def settle(self) -> bool:
        """Mark it answered without sending anything (a tell's end); False if it already was."""
        if self._settled:
            return False
        self._settled = True
        if self._on_settled is not None:
            self._on_settled()
        return True


class LocalReply:
    """The sink of an in-process `ask`: an event the asker waits on; the first outcome wins."""

    __slots__ = ("_done", "_error", "_value")

    def __init__(self) -> None:
        self._done = anyio.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    async def resolve(self, value: Any) -> None:
        if not self._done.is_set():
            self._value = value
            self._done.set()

    async def fail(self, error: BaseException) -> None:
        if not self._done.is_set():
            self._error = error
            self._done.set()

    async def wait(self) -> Any:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        return unwrap(self._value)


class NoReply:
    """The sink of a message served without a reply subject: a one-way command from afar.

    It still reaches an actor that answers later as a `Request` (what it does must not depend
    on whether the sender waits); whatever the actor answers goes nowhere.
    """

    __slots__ = ()

    async def resolve(self, value: Any) -> None:
        pass

    async def fail(self, error: BaseException) -> None:
        pass


NO_REPLY = NoReply()


def unwrap(value: Any) -> Any:
    """An `Error` reply becomes a `CommandError`, locally and remotely alike."""
    if isinstance(value, Error):
        raise CommandError(value.code, value.message, value.retry_after)
    return value
