"""The running side of one actor: mailbox, message loop, supervision, teardown.

Split like pykka's loop into setup (instance + `on_start`), running (one message at a
time) and teardown (`on_stop`, then every request still queued fails with
`ActorDeadError`, so no asker is left hanging). Each request is answered through its own
handle (`Request`): with `receive`'s return value, or by the actor itself when it answers
later.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import structlog
from anyio.abc import TaskGroup, TaskStatus

from txactors.actors.actor import Actor
from txactors.actors.envelope import Request
from txactors.actors.ref import LocalActorRef
from txactors.actors.supervision import Directive, RestartBudget, Supervisor
from txactors.errors import (
    ActorDeadError,
    ActorError,
    ConfigError,
    MailboxFull,
    NotHandled,
    ungrouped,
)
from txactors.observe.logs import get_logger

if TYPE_CHECKING:
    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

log = get_logger(__name__)


class _Stop:
    """Mailbox sentinel that wakes an idle actor so it notices a stop request."""


_STOP = Request(_Stop())

#: Messages an actor may take from its mailbox in a row before it yields to other tasks.
FAIRNESS_BATCH = 64


class _Next(enum.Enum):
    RESTART = "restart"
    STOP = "stop"


class TaskFailed:
    """Mailbox message: a task the actor started with `start_task` raised `error`.

    `instance` is the instance that started it: a task of an instance already replaced (it
    failed while its instance was being restarted) must not fail the fresh one."""

    __slots__ = ("error", "instance")

    def __init__(self, error: Exception, instance: Actor | None = None) -> None:
        self.error = error
        self.instance = instance


class _TaskRunner:
    """Runs an instance's background tasks; a failure comes back through the mailbox so the
    supervisor handles it like a failed message (Akka's pipe-to-self, in a task group)."""

    __slots__ = ("_cell", "_instance", "_tasks")

    def __init__(self, cell: ActorCell, tasks: TaskGroup, instance: Actor) -> None:
        self._cell = cell
        self._tasks = tasks
        self._instance = instance

    def start(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        self._tasks.start_soon(self._guarded, fn, args)

    async def _guarded(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        try:
            await fn(*args)
        except Exception as error:
            log.warning(
                "actor_task_failed", task=getattr(fn, "__name__", repr(fn)), error=repr(error)
            )
            with contextlib.suppress(ActorDeadError):
                await self._cell.deliver(Request(TaskFailed(error, self._instance)))


class Escalated(ActorError):
    """An actor's failure escalated to its system (Directive.ESCALATE); the cause is chained."""


class ActorCell:
    def __init__(
        self,
        factory: Callable[[], Actor],
        name: str,
        mailbox_size: int,
        supervisor: Supervisor,
    ) -> None:
        if mailbox_size < 1:
            raise ConfigError("mailbox_size must be at least 1: mailboxes are bounded")
        self.name = name
        self.factory = factory
        self.supervisor = supervisor
        send: MemoryObjectSendStream[Request]
        receive: MemoryObjectReceiveStream[Request]
        send, receive = anyio.create_memory_object_stream[Request](mailbox_size)
        self._send = send
        self._receive = receive
        self._stopping = False
        self._current: Request | None = None
        self._instance: Actor | None = None
        self._batch = 0
        self._ready = False
        self.stopped = anyio.Event()
        self.failure: BaseException | None = None
        self.ref = LocalActorRef(self)
        self._budget = RestartBudget(supervisor)

    # -- the sending side (used by refs) ------------------------------------------------------

    def _dead(self) -> ActorDeadError:
        return ActorDeadError(f"actor {self.name!r} is stopped")

    async def deliver(self, request: Request) -> None:
        if self._stopping:
            raise self._dead()
        try:
            # The fast path skips anyio's per-send checkpoint: a yield per message costs
            # an event-loop turn each, which halved remote throughput in bench/actors.py.
            self._send.send_nowait(request)
        except anyio.WouldBlock:
            try:
                await self._send.send(request)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                raise self._dead() from None
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise self._dead() from None

    def deliver_nowait(self, request: Request) -> None:
        if self._stopping:
            raise self._dead()
        try:
            self._send.send_nowait(request)
        except anyio.WouldBlock:
            size = self._send.statistics().max_buffer_size
            raise MailboxFull(
                f"mailbox of {self.name!r} is full ({size:g} messages); "
                "use tell() to wait for room, or raise mailbox_size"
            ) from None
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise self._dead() from None

    def request_stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        # Busy actors check the flag after each message; dead ones need nothing.
        with contextlib.suppress(anyio.WouldBlock, anyio.BrokenResourceError):
            self._send.send_nowait(_STOP)

    # -- the running side ---------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The actor's task; reports ready once the first instance has started.

        Each instance lives inside its own task group, which holds the tasks it started
        with `Actor.start_task`: they end with the instance (on restart or stop). A first
        start that fails for good raises `ActorDeadError` to the spawner, not to the system;
        after that only an escalated failure leaves this task with an error.
        """
        structlog.contextvars.bind_contextvars(actor=self.name)
        try:
            while not self._stopping:
                instance = self.factory()
                instance.ref = self.ref
                self._instance = instance
                with ungrouped():  # an escalated failure leaves as itself
                    async with anyio.create_task_group() as tasks:
                        instance._task_runner = _TaskRunner(self, tasks, instance)
                        outcome = await self._live(instance, task_status)
                        tasks.cancel_scope.cancel()
                if outcome is _Next.STOP:
                    break
            if not self._ready:
                raise ActorDeadError(f"actor {self.name!r} failed to start") from self.failure
        finally:
            with anyio.CancelScope(shield=True):
                await self._teardown()

    async def _live(self, instance: Actor, task_status: TaskStatus[None]) -> _Next:
        """Start one instance, then serve it until it must restart or stop."""
        try:
            await instance.on_start()
        except Exception as error:
            log.error("actor_start_failed", error=repr(error))
            await self._supervise(instance, error, resumable=False)
            return _Next.RESTART if self.failure is None else _Next.STOP
        if not self._ready:
            self._ready = True
            task_status.started()
        return await self._serve(instance)

    async def _serve(self, instance: Actor) -> _Next:
        # A tell carries no reply sink: it reaches even an actor that answers later bare.
        later = instance.answers_later
        while not self._stopping:
            request = await self._next_request()
            if request is _STOP:
                break
            self._current = request  # stays set if we are cancelled mid-message
            handed = later and request.reply is not None
            try:
                if isinstance(request.message, TaskFailed):
                    if request.message.instance not in (None, instance):
                        log.debug("stale_task_failure_ignored", error=repr(request.message.error))
                        self._current = None
                        request.settle()
                        continue
                    raise request.message.error  # a failed background task fails its actor
                if handed:
                    await instance.receive(request)  # the actor answers through the handle
                else:
                    result = await instance.receive(request.message)
            except Exception as error:
                self._current = None
                await request.fail(error)  # nothing if the actor had answered already
                log.warning("actor_message_failed", error=repr(error), exc_info=error)
                directive = await self._supervise(instance, error, resumable=True)
                if directive is not Directive.RESUME:
                    restart = directive is Directive.RESTART and self.failure is None
                    return _Next.RESTART if restart else _Next.STOP
            else:
                self._current = None
                if handed:
                    continue  # the actor holds the handle and answers it itself
                if request.reply is None:
                    request.settle()  # a tell: settled (a pool frees its member), no answer
                else:
                    await request.answer(result)  # the same handle, answered now
        return _Next.STOP

    async def _next_request(self) -> Request:
        """Take queued requests without a loop turn each, yielding every FAIRNESS_BATCH
        so a busy actor cannot starve the others."""
        self._batch += 1
        if self._batch < FAIRNESS_BATCH:
            try:
                return self._receive.receive_nowait()
            except anyio.WouldBlock:
                pass
        self._batch = 0
        return await self._receive.receive()

    async def _supervise(self, instance: Actor, error: Exception, *, resumable: bool) -> Directive:
        """Apply the supervisor's directive; sets `failure` when the actor must end.

        An instance whose `on_start` failed never started, so RESUME means RESTART for it.
        """
        try:
            await instance.on_failure(error)
        except Exception as hook_error:
            log.error("actor_on_failure_raised", error=repr(hook_error))
        directive = self.supervisor.decide(error)
        if directive is Directive.RESUME:
            if resumable:
                return directive
            directive = Directive.RESTART
        await self._retire()
        if directive is Directive.RESTART:
            delay = self._budget.next_delay(anyio.current_time())
            if delay is None:
                log.error(
                    "actor_restart_limit_reached",
                    max_restarts=self.supervisor.max_restarts,
                    within=self.supervisor.within,
                    error=repr(error),
                )
                self.failure = error
            else:
                log.info("actor_restarting", delay=delay)
                await anyio.sleep(delay)
        elif directive is Directive.STOP:
            self.failure = error
        else:
            self.failure = Escalated(f"actor {self.name!r} escalated {error!r}")
            self.failure.__cause__ = error
            raise self.failure
        return directive

    async def _retire(self) -> None:
        """Run the current instance's `on_stop` once; later calls find nothing to retire."""
        instance, self._instance = self._instance, None
        if instance is None:
            return
        try:
            await instance.on_stop()
        except Exception as error:
            log.error("actor_on_stop_raised", error=repr(error))

    async def _teardown(self) -> None:
        self._stopping = True
        await self._retire()
        dead = self._dead()
        if self._current is not None:
            await self._current.fail(dead)  # cancelled mid-message (forced shutdown)
        while True:
            try:
                request = self._receive.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream):
                break
            await request.fail(NotHandled(f"actor {self.name!r} stopped before handling it"))
        self._receive.close()  # senders still waiting for room get ActorDeadError
        self._send.close()
        self.stopped.set()
        log.debug("actor_stopped", failure=repr(self.failure) if self.failure else None)
