"""Partitions are leased: coordinators split them, stand by for each other, and stop serving
a partition whose lease they lost."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

import anyio
import nats
import nats.js.errors
import pytest
from anyio.abc import TaskStatus
from nats.aio.client import Client

from tests.support.txn import CoordinatorClient, message, topic_ids
from tests.support.wait import eventually
from txactors.coordinator.cluster.leases import Leases
from txactors.coordinator.core.records import OpKind, OpRecord
from txactors.coordinator.options import CoordinatorOptions
from txactors.coordinator.partition import actor as partition_module
from txactors.coordinator.partition import oplog as oplog_module
from txactors.coordinator.partition.checkpoints import encode_ops
from txactors.coordinator.partition.oplog import OpLog, OpWriter
from txactors.coordinator.service import RunningCoordinator, run_coordinator
from txactors.errors import ActorDeadError, AskTimeout, CommandError
from txactors.producer import Decision, TransactionProducer, TxMessage
from txactors.producer.link import DEFAULT_MAX_ITEMS
from txactors.wire import layout
from txactors.wire.protocol import PROTOCOL_VERSION, ListTransactions

QUICK = CoordinatorOptions(lease_ttl=0.6)


async def test_a_standby_takes_over_open_transactions_when_the_owner_leaves(
    private_nc: Client,
) -> None:
    url = private_nc.connected_url.geturl() if private_nc.connected_url else ""
    owner_nc = await nats.connect(url)
    owner_leaves = anyio.Event()

    async def run_owner(*, task_status: TaskStatus[RunningCoordinator]) -> None:
        async with run_coordinator(owner_nc, options=QUICK, owner="owner") as owner:
            task_status.started(owner)
            await owner_leaves.wait()

    try:
        client = CoordinatorClient(private_nc)
        async with anyio.create_task_group() as tg:
            owner = await tg.start(run_owner)
            async with run_coordinator(private_nc, options=QUICK, owner="standby") as standby:
                assert (owner.partitions, standby.partitions) == ([0], [])
                receipt = await client.prepare("t1", message())
                owner_leaves.set()
                await eventually(
                    lambda: standby.partitions == [0], timeout=5, what="the standby owns 0"
                )
                ended = await client.end("t1", receipt.token, Decision.COMMIT)
                assert ended.state == "committed", "the standby recovered the open transaction"
        assert await topic_ids(private_nc, "orders") == ["t1:0"]
    finally:
        await owner_nc.close()


@pytest.mark.serial  # a lease TTL of real time: failed beside parallel workers
async def test_a_waiting_coordinator_takes_over_within_the_lease_ttl(private_nc: Client) -> None:
    url = private_nc.connected_url.geturl() if private_nc.connected_url else ""
    other_nc = await nats.connect(url)
    try:
        async with run_coordinator(other_nc, options=QUICK, owner="waiting") as waiting:
            assert waiting.partitions == [0]
        # Hand-made stale lease, as a crashed owner would leave it: nobody renews it.
        kv = await private_nc.jetstream().key_value(layout.LEASE_BUCKET)
        await kv.create("0", b"crashed")
        async with run_coordinator(private_nc, options=QUICK, owner="heir") as heir:
            assert heir.partitions == []
            await eventually(lambda: heir.partitions == [0], timeout=5, what="the heir owns 0")
            client = CoordinatorClient(private_nc)
            receipt = await client.prepare("t2", message())
            assert (await client.end("t2", receipt.token, Decision.COMMIT)).state == "committed"
    finally:
        await other_nc.close()


async def test_coordinators_split_partitions_and_serve_them_all(private_nc: Client) -> None:
    url = private_nc.connected_url.geturl() if private_nc.connected_url else ""
    other_nc = await nats.connect(url)
    split = CoordinatorOptions(partitions=2, max_partitions=1, lease_ttl=3.0)
    try:
        async with (
            run_coordinator(private_nc, options=split, owner="a") as a,
            run_coordinator(other_nc, options=split, owner="b") as b,
            TransactionProducer(
                private_nc, "shop", lambda view: Decision.ROLLBACK, partitions=2
            ) as producer,
        ):
            assert sorted(a.partitions + b.partitions) == [0, 1]
            assert len(a.partitions) == len(b.partitions) == 1
            txids = []
            # A producer fills one partition at a time, moving on after DEFAULT_MAX_ITEMS
            # transactions (producer/sticky.py): a few more than that reach both.
            for n in range(DEFAULT_MAX_ITEMS + 12):
                result = await producer.send_in_transaction(
                    TxMessage("orders", str(n).encode()), lambda m, arg: Decision.COMMIT
                )
                assert result.state == "committed"
                txids.append(result.txid)
            partitions = {layout.partition_of(t, 2) for t in txids}
            assert partitions == {0, 1}, "both partitions carried transactions"
        assert sorted(await topic_ids(private_nc, "orders")) == sorted(f"{t}:0" for t in txids)
    finally:
        await other_nc.close()


@pytest.mark.serial  # a lease TTL of real time: failed beside parallel workers
async def test_an_owner_that_lost_its_lease_stops_serving(private_nc: Client) -> None:
    async with run_coordinator(private_nc, options=QUICK, owner="owner") as owner:
        client = CoordinatorClient(private_nc)
        assert (await client.admin(ListTransactions(version=PROTOCOL_VERSION))).transactions == []
        kv = await private_nc.jetstream().key_value(layout.LEASE_BUCKET)
        await kv.put("0", b"intruder")  # someone else holds it now
        await eventually(lambda: not owner.partitions, timeout=5, what="the owner gave up 0")
        with pytest.raises(ActorDeadError):
            await client.admin(ListTransactions(version=PROTOCOL_VERSION))


async def test_a_coordinator_keeps_its_lease_while_a_partition_recovers_for_long(
    private_nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recovery is made to take three lease TTLs (a delay injected before the real one):
    the lease must be renewed meanwhile, or a standby could take the partition."""
    options = CoordinatorOptions(lease_ttl=1.0, tick_interval=0.05)
    async with run_coordinator(private_nc, options=options):
        pass  # creates the lease bucket with this TTL
    real_recover = partition_module.recover

    async def slow_recover(*args: Any, **kwargs: Any) -> tuple[int, int]:
        await anyio.sleep(3 * options.lease_ttl)  # the scenario: a recovery that takes long
        return await real_recover(*args, **kwargs)

    monkeypatch.setattr(partition_module, "recover", slow_recover)
    kv = await private_nc.jetstream().key_value(layout.LEASE_BUCKET)
    holders: list[bytes | None] = []

    async def watch_lease() -> None:
        while True:
            try:
                holders.append((await kv.get("0")).value)
            except nats.js.errors.KeyNotFoundError:
                holders.append(None)
            await anyio.sleep(0.05)  # the next sample: a watch that runs until cancelled

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_lease)
        async with run_coordinator(private_nc, options=options, owner="slow") as slow:
            assert slow.partitions == [0]
            client = CoordinatorClient(private_nc)
            receipt = await client.prepare("t1", message())
            assert (await client.end("t1", receipt.token, Decision.COMMIT)).state == "committed"
            tg.cancel_scope.cancel()
    held = list(itertools.dropwhile(lambda h: h is None, holders))
    assert len(held) > 40, "watched through the whole recovery"
    assert set(held) == {b"slow"}, "the lease never lapsed while the partition recovered"


async def test_a_record_landing_after_the_new_owners_fence_fences_it_out_not_for_good(
    private_nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second writer's op record lands right after the new owner took its fence (as a
    stalled owner's would): the new owner's first write is refused and it stops (it never
    writes behind another's record), but the partition is given back, taken again, and the
    record applied by the next instance: it does not end in a partition that never serves."""
    async with run_coordinator(private_nc, options=QUICK):
        client = CoordinatorClient(private_nc)
        warm_up = await client.prepare("warm-up", message())
        await client.end("warm-up", warm_up.token, Decision.COMMIT)
        receipt = await client.prepare("zombie-commit", message())
    js = private_nc.jetstream()
    commit = OpRecord(txid="zombie-commit", kind=OpKind.COMMIT, half_seqs=tuple(receipt.seqs))
    real_open = OpWriter.open
    opened: list[int] = []

    def open_then_another_writes(self: OpWriter, partition: int, *args: Any) -> OpLog:
        log = real_open(self, partition, *args)
        opened.append(log.last_seq)
        if len(opened) == 1:  # right after the first instance took its fence
            publishing = js.publish(layout.op_subject(0), encode_ops([commit]))
            landed.append(asyncio.ensure_future(publishing))
        return log

    landed: list[asyncio.Future[Any]] = []
    monkeypatch.setattr(OpWriter, "open", open_then_another_writes)
    async with run_coordinator(private_nc, options=QUICK) as coordinator:
        client = CoordinatorClient(private_nc)
        await eventually(lambda: landed, what="the other writer's record sent")
        record_seq = (await landed[0]).seq
        # The first instance's first write (this end's commit) is refused: it stops.
        with contextlib.suppress(CommandError, AskTimeout, ActorDeadError):
            first = await client.prepare("first", message())
            await client.end("first", first.token, Decision.COMMIT)
        await eventually(
            lambda: topic_ids(private_nc, "orders"),
            until=lambda ids: "zombie-commit:0" in ids,
            timeout=10,
            what="the record applied by a later instance of the partition",
        )
        assert len(opened) >= 2 and opened[0] < record_seq <= opened[-1]
        await eventually(lambda: coordinator.partitions == [0], timeout=5, what="serving 0")
        after = await client.prepare("after", message())
        assert (await client.end("after", after.token, Decision.COMMIT)).state == "committed"


async def test_a_leaver_gives_its_lease_back_only_once_its_op_write_in_flight_settled(
    private_nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner leaves while a commit's op record is sent and its ack not yet taken in (as
    under CPU pressure): the lease stays held until that write settles, then is given back.
    Given back before, a successor could take its fence under the record and be fenced out."""
    options = CoordinatorOptions(lease_ttl=10.0)  # no lapse while the write is held
    real_await_ack = oplog_module.await_ack
    armed, held, release = False, anyio.Event(), anyio.Event()

    async def held_ack(*args: Any) -> Any:
        outcome = await real_await_ack(*args)
        if armed and not held.is_set():
            held.set()
            await release.wait()
        return outcome

    real_give_back = Leases.give_back
    settled_when_given_back: list[bool] = []
    given_back = anyio.Event()

    async def recorded_give_back(self: Leases, partition: int, revision: int) -> None:
        settled_when_given_back.append(release.is_set())
        await real_give_back(self, partition, revision)
        given_back.set()

    monkeypatch.setattr(oplog_module, "await_ack", held_ack)
    monkeypatch.setattr(Leases, "give_back", recorded_give_back)
    leave = anyio.Event()

    async def run_owner(*, task_status: TaskStatus[RunningCoordinator]) -> None:
        async with run_coordinator(private_nc, options=options, owner="leaver") as owner:
            task_status.started(owner)
            await leave.wait()

    async def end(token: str) -> None:
        with contextlib.suppress(CommandError, AskTimeout, ActorDeadError):
            await client.end("t1", token, Decision.COMMIT)  # never answered: the owner left

    client = CoordinatorClient(private_nc)
    async with anyio.create_task_group() as tg:
        owner = await tg.start(run_owner)
        kv = await private_nc.jetstream().key_value(layout.LEASE_BUCKET)
        receipt = await client.prepare("t1", message())
        armed = True
        tg.start_soon(end, receipt.token)
        with anyio.fail_after(5):
            await held.wait()  # the commit's record is sent, its ack held
        actor = owner.owned[0].ref
        assert actor is not None
        leave.set()
        with anyio.fail_after(5):
            await actor.wait_stopped()
        with anyio.move_on_after(1.0):  # a leaver not waiting gives it back at once
            await given_back.wait()
        assert settled_when_given_back == [], "given back while its op write was in flight"
        assert (await kv.get("0")).value == b"leaver"
        release.set()
        with anyio.fail_after(10):
            await given_back.wait()
        assert settled_when_given_back == [True]
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await kv.get("0")
        tg.cancel_scope.cancel()  # the end never answered
