"""Shares of the partitions (pure), and lease keeping that rides out an election of the lease
bucket: a keeper driven by a fake clock against leases whose renewals fail for a while."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, cast

import anyio
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import StreamInfo

from txactors.coordinator.cluster.balance import MemberInfo, plan, shares
from txactors.coordinator.cluster.leases import Leases, LeaseView, lease_bucket
from txactors.coordinator.options import CoordinatorOptions
from txactors.coordinator.service import (
    RENEW_FRACTION,
    RETRY_FRACTION,
    SELF_FENCE_FRACTION,
    _Owned,
    _PartitionKeeper,
)


def member(max_partitions: int = 1 << 16, partitions: int = 8) -> MemberInfo:
    return MemberInfo(partitions=partitions, max_partitions=max_partitions)


# -- shares and plans (pure) ---------------------------------------------------------------------


def test_shares_are_even_and_the_extra_ones_stay_where_they_are() -> None:
    caps = dict.fromkeys("abc", 100)
    assert shares(8, caps, {}) == {"a": 3, "b": 3, "c": 2}, "by owner id when nobody holds any"
    assert shares(8, caps, {"c": 3, "b": 3, "a": 2}) == {"a": 2, "b": 3, "c": 3}, (
        "a split within one of even is left as it is"
    )
    assert shares(4, caps, {"a": 2, "b": 2}) == {"a": 2, "b": 1, "c": 1}


def test_shares_respect_max_partitions() -> None:
    assert shares(8, {"a": 1, "b": 100}, {}) == {"a": 1, "b": 7}
    assert shares(8, {"a": 2, "b": 3}, {}) == {"a": 2, "b": 3}, "the rest stays free"
    assert shares(3, {"a": 0, "b": 5}, {}) == {"a": 0, "b": 3}


def test_a_member_that_joins_gets_its_share_handed_over_a_few_at_a_time() -> None:
    members = {"a": member(), "b": member()}
    holders = dict.fromkeys(range(8), "a")
    step = plan(
        me="a", partitions=8, members=members, holders=holders, owned=frozenset(range(8)), batch=2
    )
    assert (step.share, step.give) == (4, (7, 6))
    # Given back and not taken yet: the next step waits for b to take them.
    del holders[7], holders[6]
    step = plan(
        me="a", partitions=8, members=members, holders=holders, owned=frozenset(range(6)), batch=2
    )
    assert step.give == ()
    newcomer = plan(
        me="b", partitions=8, members=members, holders=holders, owned=frozenset(), batch=2
    )
    assert (newcomer.share, newcomer.take) == (4, (6, 7))


def test_partitions_whose_log_our_server_leads_are_given_last_and_taken_first() -> None:
    members = {"a": member(), "b": member()}
    near = frozenset({6, 7})  # a's server leads the logs of 6 and 7
    step = plan(
        me="a",
        partitions=8,
        members=members,
        holders=dict.fromkeys(range(8), "a"),
        owned=frozenset(range(8)),
        batch=2,
        near=near,
    )
    assert (step.share, step.give) == (4, (5, 4))
    newcomer = plan(
        me="b",
        partitions=8,
        members=members,
        holders={p: "a" for p in range(8) if p not in (2, 5)},
        owned=frozenset(),
        batch=2,
        near=frozenset({5}),
    )
    assert newcomer.take == (5, 2)


def test_partitions_of_a_member_that_is_gone_are_worth_trying() -> None:
    step = plan(
        me="a",
        partitions=4,
        members={"a": member()},
        holders={0: "a", 1: "dead", 2: "dead"},
        owned=frozenset({0}),
        batch=2,
    )
    assert (step.share, step.take, step.give) == (4, (1, 2, 3), ())


def test_no_handover_when_nobody_would_take_it() -> None:
    step = plan(
        me="a",
        partitions=4,
        members={"a": member(), "b": member(max_partitions=0)},
        holders=dict.fromkeys(range(4), "a"),
        owned=frozenset(range(4)),
        batch=2,
    )
    assert (step.share, step.give, step.take) == (4, (), ())


# -- lease keeping through an election of the lease bucket ---------------------------------------


class Election(Exception):
    """What a renewal meets while the bucket has no leader (a timeout, no responders)."""


class FlakyLeases:
    """A Leases double: renewals fail while `electing`; what was given back is recorded."""

    owner = "me"

    def __init__(self) -> None:
        self.electing = False
        self.revision = 1
        self.renewals = 0
        self.given_back: list[int] = []

    async def renew(self, partition: int, revision: int) -> int | None:
        self.renewals += 1
        if self.electing:
            raise Election("no leader")
        self.revision += 1
        return self.revision

    async def announce(self, info: MemberInfo) -> None:
        if self.electing:
            raise Election("no leader")

    async def give_back(self, partition: int, revision: int) -> None:
        self.given_back.append(partition)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


TTL = 10.0


async def settled_at_once(partition: int) -> None:
    """No op write in flight: these partitions have no actor."""


def keeper_for(
    leases: FlakyLeases,
    clock: FakeClock,
    settled: Callable[[int], Awaitable[None]] = settled_at_once,
) -> _PartitionKeeper:
    unused = cast(Any, None)
    keeper = _PartitionKeeper(
        unused,
        unused,
        cast(Leases, leases),
        CoordinatorOptions(partitions=2, lease_ttl=TTL),
        unused,
        unused,
        settled=settled,
        clock=clock,
    )
    keeper.owned[0] = _Owned(revision=1, renewed_at=0.0)
    return keeper


async def test_failed_renewals_are_retried_soon_and_the_owner_keeps_serving() -> None:
    leases, clock = FlakyLeases(), FakeClock()
    keeper = keeper_for(leases, clock)
    clock.now = TTL * RENEW_FRACTION
    leases.electing = True
    delays = []
    while clock.now < TTL * 0.7:
        delays.append(await keeper.keep_owned())
        assert 0 in keeper.owned, f"still serving at {clock.now:.2f}s"
        clock.now += delays[-1]
    assert delays[0] == pytest.approx(TTL * RETRY_FRACTION), "retried soon, not a third later"
    assert leases.renewals >= 4
    leases.electing = False  # the bucket has a leader again
    assert await keeper.keep_owned() == pytest.approx(TTL * RENEW_FRACTION)
    assert keeper.owned[0].renewed_at == clock.now and keeper.owned[0].revision == leases.revision
    assert leases.given_back == []


async def test_an_owner_that_cannot_renew_stops_serving_at_the_self_fence_point() -> None:
    leases, clock = FlakyLeases(), FakeClock()
    keeper = keeper_for(leases, clock)
    leases.electing = True
    clock.now = TTL * RENEW_FRACTION
    while True:
        delay = await keeper.keep_owned()
        if 0 not in keeper.owned:
            break
        assert clock.now < TTL * SELF_FENCE_FRACTION, "still serving at the fence"
        clock.now += delay
    assert clock.now == pytest.approx(TTL * SELF_FENCE_FRACTION), "not a moment later"
    assert leases.given_back == [], "a lease it cannot renew is not given back either"


async def test_an_owner_woken_from_a_long_stall_stops_before_it_renews() -> None:
    leases, clock = FlakyLeases(), FakeClock()
    keeper = keeper_for(leases, clock)
    clock.now = TTL * 1.5  # e.g. SIGSTOPped past the TTL: a successor may serve it now
    await keeper.keep_owned()
    assert keeper.owned == {} and leases.renewals == 0


class DeadActor:
    is_alive = False

    async def stop(self) -> None:
        pass


async def test_a_dead_partition_is_given_back_once_settled_without_holding_renewals_back() -> None:
    """A partition whose actor died is given back once its op write in flight settled; that
    wait runs beside the other partitions' renewals (here it ends only after they are sent),
    never before them: a renewal held back past the self-fence point stops the others too."""
    order: list[str] = []
    renewed = anyio.Event()

    class RecordingLeases(FlakyLeases):
        async def renew(self, partition: int, revision: int) -> int | None:
            order.append(f"renewed {partition}")
            renewed.set()
            return await super().renew(partition, revision)

        async def give_back(self, partition: int, revision: int) -> None:
            order.append(f"given back {partition}")
            await super().give_back(partition, revision)

    async def settled_after_the_renewals(partition: int) -> None:
        await renewed.wait()  # the write settles only once the others' renewals are sent
        order.append(f"settled {partition}")

    leases, clock = RecordingLeases(), FakeClock()
    keeper = keeper_for(leases, clock, settled_after_the_renewals)
    keeper.owned[1] = _Owned(revision=1, renewed_at=0.0, ref=cast(Any, DeadActor()))
    clock.now = TTL * RENEW_FRACTION
    with anyio.fail_after(TTL * RETRY_FRACTION):
        await keeper.keep_owned()
    assert order == ["renewed 0", "settled 1", "given back 1"]
    assert list(keeper.owned) == [0] and leases.given_back == [1]


async def test_a_renewal_that_landed_unanswered_keeps_the_lease(private_nc: Client) -> None:
    """The bucket took the renewal but its answer was lost: the retry's revision is stale,
    yet the lease is still ours."""
    kv = await lease_bucket(private_nc.jetstream(), ttl=TTL, replicas=1)
    js = private_nc.jetstream()
    leases, other = Leases(js, kv, "me"), Leases(js, kv, "other")
    first = await leases.take(0)
    assert first is not None
    landed = await kv.update("0", b"me", last=first)  # the renewal whose answer was lost
    renewed = await leases.renew(0, first)
    assert renewed is not None and renewed > landed
    await kv.put("0", b"other")  # someone else holds it now
    assert await leases.renew(0, renewed) is None
    assert await other.holder(0) == "other"


class ElectingBucket:
    """JetStream whose lease bucket has no leader: requests wait (nats-py would wait 5 s)."""

    async def stream_info(self, name: str, subjects_filter: str | None = None) -> Any:
        await anyio.sleep_forever()


async def test_a_view_of_a_bucket_without_a_leader_gives_up_within_its_timeout() -> None:
    """Otherwise partitions left free during the bucket's election wait out the JetStream API
    timeout before anyone takes them again."""
    bucket = cast(Any, ElectingBucket())
    leases = Leases(bucket, bucket, "me")
    with anyio.fail_after(2), pytest.raises(TimeoutError):
        await leases.view(timeout=0.1)


class OldServer:
    """JetStream as a server without `subjects_filter` answers: no subjects in stream info."""

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js

    async def stream_info(self, name: str, subjects_filter: str | None = None) -> StreamInfo:
        return await self._js.stream_info(name)


async def test_a_view_has_the_live_members_and_holders(private_nc: Client) -> None:
    """Read key by key, or through a watch from a server that cannot list the keys."""
    js = private_nc.jetstream()
    kv = await lease_bucket(js, ttl=TTL, replicas=1)
    me, other = Leases(js, kv, "me"), Leases(js, kv, "other")
    await me.announce(member(partitions=4))
    await other.announce(member(partitions=4))
    await other.withdraw()
    assert await me.take(0) is not None
    given = await other.take(1)
    assert given is not None and await other.take(2) is not None
    await other.give_back(1, given)
    await kv.put("member.broken", b"not json")
    expected = LeaseView(members={"me": member(partitions=4)}, holders={0: "me", 2: "other"})
    assert await me.view(timeout=5) == expected
    old = Leases(cast(Any, OldServer(js)), kv, "me")
    assert await old.view(timeout=5) == expected
