"""`ActorSystem`: owns the task group every actor runs in.

Structured concurrency gives the lifetime rule for free: leaving `async with ActorSystem()`
stops every actor (each finishes the message in hand; queued asks fail with
`ActorDeadError`), and an escalated failure cancels the system and surfaces to its owner
(as `Escalated`, not inside an exception group; so does an error of the block itself).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from types import TracebackType
from typing import Self, TypeVar

import anyio
from anyio.abc import TaskGroup

from txactors.actors.actor import Actor
from txactors.actors.cell import ActorCell
from txactors.actors.ref import LocalActorRef
from txactors.actors.supervision import Supervisor
from txactors.errors import ActorError, ungrouped
from txactors.observe.logs import get_logger

A = TypeVar("A", bound=Actor)

DEFAULT_MAILBOX_SIZE = 1024

log = get_logger(__name__)


class ActorSystem:
    def __init__(self, name: str = "txactors", *, shutdown_timeout: float = 10.0) -> None:
        self.name = name
        self.shutdown_timeout = shutdown_timeout
        self._cells: dict[str, ActorCell] = {}
        self._task_group: TaskGroup | None = None
        self._ids = itertools.count(1)

    async def __aenter__(self) -> Self:
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._task_group is not None
        try:
            with anyio.CancelScope(shield=exc_type is None) as scope:
                scope.deadline = anyio.current_time() + self.shutdown_timeout
                await self.shutdown()
            if scope.cancelled_caught:
                log.warning("actor_system_forced_shutdown", timeout=self.shutdown_timeout)
                self._task_group.cancel_scope.cancel()
        finally:
            tasks, self._task_group = self._task_group, None
            with ungrouped():
                result = await tasks.__aexit__(exc_type, exc, tb)
        return result

    async def spawn(
        self,
        factory: Callable[[], A],
        *,
        name: str | None = None,
        mailbox_size: int = DEFAULT_MAILBOX_SIZE,
        supervisor: Supervisor | None = None,
    ) -> LocalActorRef:
        """Start an actor and return its ref once `on_start` has run.

        `factory` builds a fresh instance (a class works); it is called again on restart,
        which is how a restarted actor gets fresh state.
        """
        if self._task_group is None:
            raise ActorError("the ActorSystem is not running; use `async with ActorSystem()`")
        actor_name = name or f"{getattr(factory, '__name__', 'actor')}-{next(self._ids)}"
        if actor_name in self._cells and not self._cells[actor_name].stopped.is_set():
            raise ActorError(f"an actor named {actor_name!r} is already running")
        cell = ActorCell(factory, actor_name, mailbox_size, supervisor or Supervisor())
        self._cells[actor_name] = cell
        await self._task_group.start(self._run_cell, cell, name=f"actor:{actor_name}")
        return cell.ref

    async def _run_cell(self, cell: ActorCell, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        try:
            await cell.run(task_status=task_status)
        finally:
            if self._cells.get(cell.name) is cell:
                del self._cells[cell.name]

    def get(self, name: str) -> LocalActorRef | None:
        cell = self._cells.get(name)
        return cell.ref if cell is not None else None

    async def shutdown(self) -> None:
        """Stop every actor and wait for them; idempotent."""
        cells = list(self._cells.values())
        for cell in cells:
            cell.request_stop()
        for cell in cells:
            await cell.stopped.wait()
