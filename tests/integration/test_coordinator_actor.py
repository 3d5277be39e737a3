"""The partition actor's shape: two mailbox hops per commit, and a checker of its own.

The checker is driven here by the coordinator's injectable clock alone (no NATS: a partition
stand-in collects what it says), and the hop count is what the partition's mailbox receives
for one transaction, prepared and committed, on a real server.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest
from nats.aio.client import Client

from tests.support.partition import FakePartition, Recorder
from tests.support.txn import CoordinatorClient, message
from tests.support.wait import eventually
from txactors.actors import ActorRef, ActorSystem, Request
from txactors.actors.cell import ActorCell
from txactors.coordinator.options import Clock
from txactors.coordinator.partition.checker import Checker, CheckWork, Due
from txactors.coordinator.service import run_coordinator
from txactors.testing import ManualClock
from txactors.wire.protocol import Decision

TICK = 0.01


async def spawn_checker(
    system: ActorSystem, nc: Client, recorder: Recorder, *, clock: Clock, tick: float
) -> ActorRef:
    """Partition 0's checker (epoch 7), telling a stand-in partition that records it."""
    partition = await system.spawn(lambda: FakePartition(recorder), name="partition")
    return await system.spawn(
        lambda: Checker(
            nc=nc,
            js=nc.jetstream(),
            partition=0,
            owner=partition,
            epoch=7,
            clock=clock,
            tick_interval=tick,
        ),
        name="checker",
    )


async def heard_due(heard: list[Any], count: int) -> None:
    await eventually(
        lambda: sum(isinstance(m, Due) for m in heard) >= count, what=f"{count} Due told"
    )


async def test_the_checker_reports_due_only_once_the_coordinators_clock_passes_the_deadline(
    private_nc: Client,
) -> None:
    now = [1_000.0]
    recorder = Recorder()
    heard = recorder.heard
    async with ActorSystem() as system:
        checker = await spawn_checker(system, private_nc, recorder, clock=lambda: now[0], tick=TICK)
        await heard_due(heard, 1)  # a fresh checker knows no deadline: it asks at once
        assert heard == [Due(7)]
        await checker.tell(CheckWork(deadline=1_600.0))
        await anyio.sleep(TICK * 5)  # several ticks of real time: the virtual clock stood still
        assert heard == [Due(7)]
        now[0] = 1_600.0
        await heard_due(heard, 2)
        await anyio.sleep(TICK * 5)  # the scenario: ticks pass, and no second Due may come
        assert heard == [Due(7), Due(7)], "due once per deadline told, not once per tick"


async def test_the_checker_sleeps_until_its_deadline_and_wakes_for_an_earlier_one(
    private_nc: Client,
) -> None:
    # A tick of a minute: a checker that ticked would not see either deadline in time.
    recorder = Recorder()
    heard = recorder.heard
    async with ActorSystem() as system:
        checker = await spawn_checker(system, private_nc, recorder, clock=time.time, tick=60.0)
        await heard_due(heard, 1)
        await checker.tell(CheckWork(deadline=time.time() + 600))
        await checker.tell(CheckWork(deadline=time.time() + 0.05))  # earlier: it wakes for it
        await heard_due(heard, 2)


async def test_the_checker_wakes_when_a_moving_clock_passes_its_deadline(
    private_nc: Client,
) -> None:
    clock = ManualClock(1_000.0)
    recorder = Recorder()
    heard = recorder.heard
    async with ActorSystem() as system:
        checker = await spawn_checker(system, private_nc, recorder, clock=clock, tick=60.0)
        await heard_due(heard, 1)
        await checker.tell(CheckWork(deadline=1_600.0))
        clock.advance(599)
        await anyio.sleep(TICK * 5)
        assert heard == [Due(7)], "not due before the clock passes the deadline"
        clock.advance(1)
        await heard_due(heard, 2)


@pytest.fixture
def partition_mail(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The type of every message delivered to partition 0's mailbox."""
    delivered: list[str] = []
    deliver, deliver_nowait = ActorCell.deliver, ActorCell.deliver_nowait

    def note(cell: ActorCell, envelope: Request) -> None:
        if cell.name == "coordinator-0":
            inner = getattr(envelope.message, "message", envelope.message)
            delivered.append(type(inner).__name__)

    async def counted(cell: ActorCell, envelope: Request) -> None:
        note(cell, envelope)
        await deliver(cell, envelope)

    def counted_nowait(cell: ActorCell, envelope: Request) -> None:  # served in the read loop
        note(cell, envelope)
        deliver_nowait(cell, envelope)

    monkeypatch.setattr(ActorCell, "deliver", counted)
    monkeypatch.setattr(ActorCell, "deliver_nowait", counted_nowait)
    return delivered


async def test_a_commit_takes_two_mailbox_hops_its_prepare_and_its_end(
    private_nc: Client, partition_mail: list[str]
) -> None:
    async with run_coordinator(private_nc):
        client = CoordinatorClient(private_nc)
        await client.prepare("warm-up", message())  # the topic stream exists from now on
        partition_mail.clear()
        receipt = await client.prepare("t1", message(), message())
        assert (await client.end("t1", receipt.token, Decision.COMMIT)).state == "committed"
    assert partition_mail == ["Prepare", "EndTransaction"]
