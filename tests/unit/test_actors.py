"""The local actor runtime: ordering, ask timeouts, backpressure, supervision, shutdown."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest

from tests.support.wait import eventually
from txactors.actors import Actor, ActorSystem, Directive, Escalated, Supervisor
from txactors.errors import ActorDeadError, AskTimeout, CommandError, MailboxFull, NotHandled
from txactors.wire.protocol import Error, ErrorCode


class Recorder(Actor):
    """Appends every message; `("get",)` returns what it has seen."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    async def receive(self, message: Any) -> Any:
        if message == ("get",):
            return list(self.seen)
        self.seen.append(message)
        return None


class Gate(Actor):
    """Blocks on a shared event for every "wait" message: lets tests fill the mailbox."""

    def __init__(self, gate: anyio.Event, entered: anyio.Event | None = None) -> None:
        self.gate = gate
        self.entered = entered

    async def receive(self, message: Any) -> Any:
        if message == "wait":
            if self.entered is not None:
                self.entered.set()
            await self.gate.wait()
        return message


async def test_messages_to_one_actor_are_handled_in_send_order() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Recorder)
        for i in range(500):
            await ref.tell(i)
        assert await ref.ask(("get",)) == list(range(500))


async def test_ask_past_its_timeout_raises_a_timeout_error_subclass() -> None:
    gate = anyio.Event()
    async with ActorSystem() as system:
        ref = await system.spawn(lambda: Gate(gate))
        with pytest.raises(AskTimeout) as caught:
            await ref.ask("wait", timeout=0.05)
        assert isinstance(caught.value, TimeoutError)
        gate.set()
        assert await ref.ask("after") == "after"


async def test_full_mailbox_makes_tell_wait_and_tell_nowait_raise() -> None:
    gate, entered = anyio.Event(), anyio.Event()
    async with ActorSystem() as system:
        ref = await system.spawn(lambda: Gate(gate, entered), mailbox_size=2)
        await ref.tell("wait")
        await entered.wait()  # the actor holds "wait"; the mailbox is empty again
        await ref.tell(1)
        await ref.tell(2)
        with pytest.raises(MailboxFull, match="full"):
            ref.tell_nowait(3)

        sent = anyio.Event()

        async def blocked_sender() -> None:
            await ref.tell(3)
            sent.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(blocked_sender)
            await anyio.sleep(0.05)  # the scenario: a while in which the tell must not get in
            assert not sent.is_set(), "tell must wait while the mailbox is full"
            gate.set()
            with anyio.fail_after(2):
                await sent.wait()


class Counter(Actor):
    """Counts; "boom" raises. Tracks lifecycle calls in a shared journal."""

    def __init__(self, journal: list[str]) -> None:
        self.count = 0
        self.journal = journal

    async def on_start(self) -> None:
        self.journal.append("start")

    async def on_stop(self) -> None:
        self.journal.append("stop")

    async def on_failure(self, error: Exception) -> None:
        self.journal.append(f"failure:{error}")

    async def receive(self, message: Any) -> Any:
        if message == "boom":
            raise RuntimeError("boom")
        self.count += 1
        return self.count


async def test_crashing_actor_restarts_with_fresh_state_and_on_failure_sees_the_error() -> None:
    journal: list[str] = []
    async with ActorSystem() as system:
        ref = await system.spawn(lambda: Counter(journal), supervisor=Supervisor(max_restarts=3))
        assert await ref.ask("inc") == 1
        assert await ref.ask("inc") == 2
        with pytest.raises(RuntimeError, match="boom"):
            await ref.ask("boom")
        assert await ref.ask("inc") == 1, "a restarted actor starts from fresh state"
        assert journal == ["start", "failure:boom", "stop", "start"]


async def test_actor_stops_after_the_restart_limit_and_reports_the_error() -> None:
    journal: list[str] = []
    policy = Supervisor(max_restarts=2, within=60, backoff_initial=0.001)
    async with ActorSystem() as system:
        ref = await system.spawn(lambda: Counter(journal), supervisor=policy)
        for _ in range(3):
            await ref.tell("boom")
        failure = await ref.wait_stopped()
        assert isinstance(failure, RuntimeError)
        assert not ref.is_alive
        assert journal.count("start") == 3  # the first instance plus two restarts
        with pytest.raises(ActorDeadError):
            await ref.ask("inc")


async def test_resume_keeps_state_and_stop_directive_ends_the_actor() -> None:
    journal: list[str] = []
    async with ActorSystem() as system:
        resumed = await system.spawn(
            lambda: Counter(journal), supervisor=Supervisor(decide=lambda e: Directive.RESUME)
        )
        assert await resumed.ask("inc") == 1
        with pytest.raises(RuntimeError):
            await resumed.ask("boom")
        assert await resumed.ask("inc") == 2, "RESUME keeps the instance and its state"

        stopped = await system.spawn(
            lambda: Counter([]), supervisor=Supervisor(decide=lambda e: Directive.STOP)
        )
        await stopped.tell("boom")
        assert isinstance(await stopped.wait_stopped(), RuntimeError)


async def test_escalate_fails_the_whole_system() -> None:
    with pytest.raises(Escalated) as caught:
        async with ActorSystem() as system:
            ref = await system.spawn(
                lambda: Counter([]), supervisor=Supervisor(decide=lambda e: Directive.ESCALATE)
            )
            await ref.tell("boom")
            await anyio.sleep(5)  # cancelled by the escalation, which fails the system
    assert isinstance(caught.value.__cause__, RuntimeError), "the actor's own error, chained"


def queued(ref: Any) -> int:
    """Messages waiting in the actor's mailbox."""
    return int(ref._cell._send.statistics().current_buffer_used)


async def test_stop_fails_queued_asks_with_actor_dead_error() -> None:
    gate, entered = anyio.Event(), anyio.Event()
    outcomes: list[Any] = []
    async with ActorSystem() as system:
        ref = await system.spawn(lambda: Gate(gate, entered))

        async def ask(message: str) -> None:
            try:
                outcomes.append(await ref.ask(message, timeout=5))
            except ActorDeadError as error:
                outcomes.append(error)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask, "wait")
            await entered.wait()
            tg.start_soon(ask, "queued-1")
            tg.start_soon(ask, "queued-2")
            await eventually(lambda: queued(ref) >= 2, what="two asks queued")
            async with anyio.create_task_group() as stopper:
                stopper.start_soon(ref.stop)
                await eventually(lambda: ref._cell._stopping, what="the stop requested")
                gate.set()
        assert outcomes[0] == "wait", "the message in hand is finished"
        # not handled at all (an ActorDeadError that says so: a caller may send it again)
        assert [type(o) for o in outcomes[1:]] == [NotHandled, NotHandled]
        with pytest.raises(ActorDeadError):
            await ref.tell("late")


async def test_system_shutdown_fails_pending_asks_instead_of_hanging() -> None:
    gate, entered = anyio.Event(), anyio.Event()
    errors: list[BaseException] = []

    async def ask(ref: Any, message: str) -> None:
        try:
            await ref.ask(message, timeout=10)
        except ActorDeadError as error:
            errors.append(error)

    async with anyio.create_task_group() as outer, ActorSystem(shutdown_timeout=0.2) as system:
        ref = await system.spawn(lambda: Gate(gate, entered))
        outer.start_soon(ask, ref, "wait")  # never released: shutdown must force it
        await entered.wait()
        outer.start_soon(ask, ref, "queued")
        await eventually(lambda: queued(ref) >= 1, what="the second ask queued")
    assert len(errors) == 2
    assert all(isinstance(e, ActorDeadError) for e in errors)


async def test_a_returned_error_reply_raises_command_error_without_a_restart() -> None:
    class Refuser(Actor):
        starts = 0

        async def on_start(self) -> None:
            Refuser.starts += 1

        async def receive(self, message: Any) -> Any:
            return Error(ErrorCode.NOT_FOUND, f"no such thing {message!r}")

    async with ActorSystem() as system:
        ref = await system.spawn(Refuser)
        with pytest.raises(CommandError) as caught:
            await ref.ask("x")
        assert caught.value.code == "not_found"
        with pytest.raises(CommandError):
            await ref.ask("y")
        assert Refuser.starts == 1


async def test_failed_first_start_raises_to_the_spawner() -> None:
    class Broken(Actor):
        async def on_start(self) -> None:
            raise OSError("database unreachable")

    async with ActorSystem() as system:
        with pytest.raises(ActorDeadError, match="failed to start") as caught:
            await system.spawn(Broken, supervisor=Supervisor(max_restarts=1, backoff_initial=0))
        assert isinstance(caught.value.__cause__, OSError)
        ok = await system.spawn(Recorder)  # the system keeps working
        assert await ok.ask(("get",)) == []


def test_supervisor_rejects_nonsense_settings() -> None:
    with pytest.raises(ValueError):
        Supervisor(max_restarts=-1)
    with pytest.raises(ValueError):
        Supervisor(backoff_initial=2, backoff_max=1)


async def test_a_busy_actor_yields_so_other_tasks_make_progress() -> None:
    gate, entered = anyio.Event(), anyio.Event()
    handled: list[int] = []
    ticks: list[int] = []

    class Busy(Actor):
        async def receive(self, message: Any) -> Any:
            if message == "wait":
                entered.set()
                await gate.wait()
            else:
                handled.append(message)  # never awaits: only the runtime can yield here

    async def ticker() -> None:
        while len(handled) < 1000:
            ticks.append(len(handled))
            await anyio.lowlevel.checkpoint()

    async with ActorSystem() as system:
        ref = await system.spawn(Busy, mailbox_size=2000)
        await ref.tell("wait")
        await entered.wait()
        for i in range(1000):
            ref.tell_nowait(i)
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            gate.set()
    assert any(0 < seen < 1000 for seen in ticks), "the ticker ran while the mailbox drained"


class Fetcher(Actor):
    """Starts slow work in a background task and keeps serving meanwhile (pipe-to-self)."""

    def __init__(self, release: anyio.Event, journal: list[str]) -> None:
        self.release = release
        self.journal = journal
        self.results: list[str] = []

    async def on_start(self) -> None:
        self.journal.append("start")

    async def receive(self, message: Any) -> Any:
        match message:
            case ("fetch", key):
                self.start_task(self.fetch, key)
            case ("fetched", value):
                self.results.append(value)
            case "explode":
                self.start_task(self.explode)
            case "results":
                return list(self.results)
        return None

    async def fetch(self, key: str) -> None:
        await self.release.wait()
        await self.ref.tell(("fetched", key.upper()))

    async def explode(self) -> None:
        raise OSError("disk on fire")


async def test_background_tasks_report_back_without_blocking_the_actor() -> None:
    release = anyio.Event()
    async with ActorSystem() as system:
        ref = await system.spawn(lambda: Fetcher(release, []))
        await ref.tell(("fetch", "a"))
        await ref.tell(("fetch", "b"))
        assert await ref.ask("results") == [], "the actor answers while its tasks wait"
        release.set()
        await eventually(
            lambda: ref.ask("results"), until=lambda got: len(got) >= 2, timeout=2, what="2 results"
        )
        assert sorted(await ref.ask("results")) == ["A", "B"]


async def test_a_failed_background_task_fails_the_actor_and_its_tasks_end_with_it() -> None:
    release, journal = anyio.Event(), []
    failures: list[Exception] = []

    class Watched(Fetcher):
        async def on_failure(self, error: Exception) -> None:
            failures.append(error)

    async with ActorSystem() as system:
        ref = await system.spawn(lambda: Watched(release, journal))
        await ref.tell(("fetch", "never"))  # pending when the instance is replaced
        await ref.tell("explode")
        await eventually(lambda: journal.count("start") >= 2, timeout=2, what="the second start")
        assert [type(f) for f in failures] == [OSError]
        release.set()
        await anyio.sleep(0.05)  # the scenario: room for a task that should be gone to finish
        assert await ref.ask("results") == [], "the old instance's task was cancelled"
