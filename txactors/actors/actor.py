"""The base class users subclass: state plus a `receive` method, with lifecycle hooks."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from txactors.actors.ref import LocalActorRef


class TaskRunner(Protocol):
    def start(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None: ...


class Actor:
    """One instance handles one message at a time, so its state needs no locks.

    `receive` returns the reply to an `ask` (ignored for a `tell`). Raising hands the error
    to the supervisor; an `ask` waiting on that message gets the exception. Returning a
    `protocol.Error` answers with an error code without counting as a failure.

    An actor that must wait (for I/O, for another actor) before it can answer sets
    `answers_later`: `receive` then gets each ask, local or served, as its `Request` handle
    and calls `request.answer(...)` when it knows, from this or a later message. A local
    tell (its own completions, say) still arrives bare; a message served without a reply
    subject arrives as a handle whose answer goes nowhere. Both ways answer through the
    same handle.
    """

    answers_later: ClassVar[bool] = False

    #: Set by the system before `on_start`: lets the actor tell itself or hand out its ref.
    ref: LocalActorRef
    _task_runner: TaskRunner

    def start_task(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run `await fn(*args)` beside the message loop, so slow I/O does not block it.

        The task reports back by telling `self.ref` a message (pipe-to-self); it is
        cancelled when this instance stops or restarts, and if it raises, the actor fails
        with that error as if a message had failed (the supervisor decides).
        """
        self._task_runner.start(fn, *args)

    async def on_start(self) -> None:
        """Runs before the first message (and after every restart, on the fresh instance)."""

    async def on_stop(self) -> None:
        """Runs when the instance is retired: on stop, shutdown, and before a restart."""

    async def on_failure(self, error: Exception) -> None:
        """Sees the error that made `receive` (or `on_start`) fail, before the directive."""

    async def receive(self, message: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement receive()")
