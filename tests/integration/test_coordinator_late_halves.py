"""Recovery reads whole streams, and halves that appear after it are still settled.

After a whole cluster restarts, a node serves its copy of a stream while still rebuilding it
from its raft log: a recovery that read then would miss halves, and their transactions would
never be checked back (their commits never published) until the next restart. Recovery waits
until each stream is current, and a partition keeps reading its halves after recovery, so a
half that shows up late is checked back like any other.
"""

from __future__ import annotations

import time
from typing import Any, cast

import anyio
import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import ClusterInfo, PeerInfo, StreamInfo

from tests.integration.test_coordinator_recovery import capture_logs
from tests.support.logstreams import ensure_log_streams
from tests.support.txn import FAST, CoordinatorClient, message, topic_ids
from tests.support.wait import eventually
from txactors.coordinator import CoordinatorConfig, CoordinatorOptions
from txactors.coordinator.core import tokens
from txactors.coordinator.core.table import TransactionTable
from txactors.coordinator.core.transactions import Checkpoint
from txactors.coordinator.partition.checkpoints import save_checkpoint
from txactors.coordinator.partition.halves import StoredHalf, half_headers, stored_half
from txactors.coordinator.partition.late import HalfEnd, LateHalves
from txactors.coordinator.partition.packs import pack_appends
from txactors.coordinator.partition.recovery import recover
from txactors.coordinator.service import run_coordinator
from txactors.nats.current import wait_current
from txactors.nats.writer import Append
from txactors.producer import CheckView, Decision, TransactionProducer, TxMessage
from txactors.wire import layout
from txactors.wire.protocol import PROTOCOL_VERSION, ListTransactions
from txactors.wire.replicas import why_not_current

OPTIONS = CoordinatorOptions(tick_interval=0.02, checkpoint_interval=0.1)
HEARD = 200_000_000
"""Nanoseconds since the leader last heard from a live replica."""
LEADERLESS = ClusterInfo(name="c", leader=None, replicas=[PeerInfo(name="n2", current=False)])
CATCHING_UP = ClusterInfo(
    name="c",
    leader="n1",
    replicas=[
        PeerInfo(name="n2", current=True, active=HEARD),
        PeerInfo(name="n3", current=False, active=HEARD),
    ],
)
CURRENT = ClusterInfo(
    name="c",
    leader="n1",
    replicas=[
        PeerInfo(name="n2", current=True, active=HEARD),
        PeerInfo(name="n3", current=True, active=HEARD),
    ],
)


def test_a_stream_is_current_with_a_leader_and_no_reachable_replica_behind() -> None:
    assert why_not_current("s", None) is None, "a single server's stream"
    assert why_not_current("s", CURRENT) is None
    assert why_not_current("s", LEADERLESS) == "s has no leader"
    assert why_not_current("s", CATCHING_UP) == "s: n3 not current"
    down = ClusterInfo(
        leader="n1",
        replicas=[
            PeerInfo(name="n2", current=True, active=HEARD),
            PeerInfo(name="n3", current=False, offline=True, active=HEARD),
        ],
    )
    assert why_not_current("s", down) is None, "a node down for good holds nothing up"
    killed = ClusterInfo(
        leader="n1",
        replicas=[
            PeerInfo(name="n2", current=True, active=HEARD),
            PeerInfo(name="n3", current=False, active=12_000_000_000),  # not heard for 12 s
        ],
    )
    assert why_not_current("s", killed) is None, "nor does one killed (never marked offline)"
    old_leader = ClusterInfo(
        leader="n1",
        replicas=[
            PeerInfo(name="n2", current=True, active=HEARD),
            PeerInfo(name="n3", current=False, active=0),  # not heard since the election
        ],
    )
    assert why_not_current("s", old_leader) is None, "nor the killed leader it replaced"


class Rebuilding:
    """A JetStream context whose TXN_HALF is being rebuilt, as after a whole cluster
    restarted: its info requests go unanswered (no leader), then it has a leader with a
    replica behind, and only then is it current, with the half `rebuilt` written by
    `catch_up` (what the raft log held and the store did not yet)."""

    def __init__(self, js: JetStreamContext, catch_up: Any) -> None:
        self._js = js
        self._catch_up = catch_up
        self._answers: list[ClusterInfo | None] = [None, LEADERLESS, CATCHING_UP]
        self.asked = 0

    async def stream_info(self, name: str, subjects_filter: str | None = None) -> StreamInfo:
        info = await self._js.stream_info(name)
        if name != layout.half_stream(0):
            return info
        self.asked += 1
        if self._answers:
            answer = self._answers.pop(0)
            if answer is None:
                raise nats.errors.TimeoutError
            info.cluster = answer
            return info
        if self._catch_up is not None:
            await self._catch_up()
            self._catch_up = None
        info.cluster = CURRENT
        return info

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)


def ignore(stored: StoredHalf) -> None:
    """What recovery remembers of each half: nothing, here."""


def written_half(txid: str, producer: str = "p1", group: str = "g") -> dict[str, str]:
    return half_headers(
        stored_half(
            txid=txid,
            token_digest=tokens.digest(tokens.new_tokens(1)[0]),
            group=group,
            producer=producer,
            begins=True,
            index=0,
            born=time.time(),
            message=message(),
        )
    )


async def test_recovery_reads_a_stream_only_once_it_is_current(private_nc: Client) -> None:
    js = private_nc.jetstream()
    await ensure_log_streams(js, half_retention=3600)

    async def catch_up() -> None:
        await js.publish(layout.half_subject(0), b"payload", headers=written_half("rebuilt"))

    rebuilding = Rebuilding(js, catch_up)
    table = TransactionTable(CoordinatorConfig())
    with capture_logs() as logs:
        with anyio.fail_after(20):
            found = await recover(
                cast(JetStreamContext, rebuilding), table, 0, Checkpoint(1, 1), ignore, 0
            )
    # asked until it was current, then once more before the op records (the same stream)
    assert rebuilding.asked == 5
    assert found.halves == 1 and table.show("rebuilt") is not None
    waits = [e["why"] for e in logs if e["event"] == "stream_not_current_yet"]
    assert waits[1:] == ["stream TXN_LOG_0 has no leader", "stream TXN_LOG_0: n3 not current"]
    assert waits[0].startswith("stream TXN_LOG_0 does not answer")


class ShortRead:
    """A JetStream context whose first read of TXN_HALF stops short: the half `gap` is
    there by the time the leader is asked for the subject's last message."""

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self._written = False

    async def get_last_msg(self, stream: str, subject: str) -> Any:
        if stream == layout.half_stream(0) and not self._written:
            self._written = True
            await self._js.publish(subject, b"payload", headers=written_half("gap"))
        return await self._js.get_last_msg(stream, subject)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)


async def test_recovery_reads_again_when_the_leader_names_a_later_half(
    private_nc: Client,
) -> None:
    js = private_nc.jetstream()
    await ensure_log_streams(js, half_retention=3600)
    await js.publish(layout.half_subject(0), b"payload", headers=written_half("first"))
    table = TransactionTable(CoordinatorConfig())
    with capture_logs() as logs:
        with anyio.fail_after(20):
            found = await recover(
                cast(JetStreamContext, ShortRead(js)), table, 0, Checkpoint(1, 1), ignore, 0
            )
    assert found.halves == 2 and table.show("gap") is not None
    assert [e["read_to"] for e in logs if e["event"] == "recovery_read_gap"] == [1]


async def test_a_stream_never_current_is_read_after_the_deadline(private_nc: Client) -> None:
    js = private_nc.jetstream()
    await ensure_log_streams(js, half_retention=3600)
    stuck = Rebuilding(js, None)
    stuck._answers = [LEADERLESS] * 1000
    with capture_logs() as logs:
        with anyio.fail_after(10):
            current = await wait_current(
                cast(JetStreamContext, stuck), layout.half_stream(0), deadline=0.5
            )
    assert not current
    [gave_up] = [e for e in logs if e["event"] == "stream_not_current_read_anyway"]
    assert gave_up["why"] == "stream TXN_LOG_0 has no leader"


async def test_a_half_that_appears_after_recovery_is_checked_back(private_nc: Client) -> None:
    asked: list[str] = []

    def checker(view: CheckView) -> Decision:
        asked.append(view.txid)
        return Decision.COMMIT

    config = CoordinatorConfig(**FAST)
    async with (
        run_coordinator(private_nc, config=config, options=OPTIONS),
        TransactionProducer(private_nc, "g", checker, instance="p-late") as producer,
    ):
        async with producer.begin() as txn:  # the coordinator has recovered and serves
            await txn.send([TxMessage("orders", b"first")])
        with capture_logs() as logs:
            # A half as a predecessor (or a copy still rebuilding) left it: in TXN_HALF
            # after this coordinator read the stream.
            headers = written_half("late", producer="p-late")
            await private_nc.jetstream().publish(layout.half_subject(0), b"late", headers=headers)
            await eventually(
                lambda: topic_ids(private_nc, "orders"),
                until=lambda ids: "late:0" in ids,
                timeout=15,
                what="the late half checked back and published",
            )
    assert asked == ["late"], "checked back once, like a recovered half"
    [found] = [e for e in logs if e["event"] == "late_half_found"]
    assert found["txid"] == "late"


def written_pack(*txids: str, producer: str = "p-late") -> Append:
    """Two halves of each of `txids` as one pack, as an earlier owner wrote them."""
    halves = [
        stored_half(
            txid=txid,
            token_digest=tokens.digest(tokens.new_tokens(1)[0]),
            group="g",
            producer=producer,
            begins=index == 0,
            index=index,
            born=time.time(),
            message=message(body=f"{txid}:{index}".encode()),
        )
        for txid in txids
        for index in range(2)
    ]
    [(pack, count)] = pack_appends(0, halves, 1 << 20)
    assert count == len(halves)
    return pack


async def test_a_pack_that_appears_after_recovery_is_read_whole_and_settled(
    private_nc: Client,
) -> None:
    asked: dict[str, list[bytes]] = {}

    def checker(view: CheckView) -> Decision:
        asked[view.txid] = [m.body for m in view.messages]
        return Decision.COMMIT if view.txid == "late-commit" else Decision.ROLLBACK

    config = CoordinatorConfig(**FAST)
    client = CoordinatorClient(private_nc)
    async with (
        run_coordinator(private_nc, config=config, options=OPTIONS),
        TransactionProducer(private_nc, "g", checker, instance="p-late") as producer,
    ):
        async with producer.begin() as txn:  # the coordinator has recovered and serves
            await txn.send([TxMessage("orders", b"first")])
        with capture_logs() as logs:
            pack = written_pack("late-commit", "late-rollback")
            await private_nc.jetstream().publish(pack.subject, pack.payload, headers=pack.headers)
            await eventually(
                lambda: topic_ids(private_nc, "orders"),
                until=lambda ids: {"late-commit:0", "late-commit:1"} <= set(ids),
                timeout=15,
                what="the late pack's committed transaction published",
            )
            await eventually(
                lambda: client.admin(ListTransactions(version=PROTOCOL_VERSION)),
                until=lambda listed: not listed.transactions,
                timeout=15,
                what="both transactions of the pack settled",
            )
    assert asked == {
        "late-commit": [b"late-commit:0", b"late-commit:1"],
        "late-rollback": [b"late-rollback:0", b"late-rollback:1"],
    }, "each checked back once, with its messages from the pack"
    assert not [i for i in await topic_ids(private_nc, "orders") if i.startswith("late-rollback")]
    found = [e["txid"] for e in logs if e["event"] == "late_half_found"]
    assert found == ["late-commit", "late-rollback"]


async def test_its_own_halves_are_never_late(private_nc: Client) -> None:
    """Even when finished transactions are forgotten at once (no recent outcomes), the
    halves this partition wrote are not taken for late ones and asked about again."""
    asked: list[str] = []

    def checker(view: CheckView) -> Decision:
        asked.append(view.txid)
        return Decision.COMMIT

    config = CoordinatorConfig(recent_outcomes=0, **FAST)
    client = CoordinatorClient(private_nc)
    with capture_logs() as logs:
        async with (
            run_coordinator(private_nc, config=config, options=OPTIONS),
            TransactionProducer(private_nc, "g", checker, instance="p1"),
        ):
            for n in range(50):
                receipt = await client.prepare(f"t{n}", message())
                await client.end(f"t{n}", receipt.token, Decision.COMMIT)
            await anyio.sleep(3 * config.transaction_timeout + 1.5)  # time for a check-back
            assert len(await topic_ids(private_nc, "orders")) == 50
    assert asked == []
    assert not [e for e in logs if e["event"] == "late_half_found"]


class AckedMeanwhile:
    """A JetStream context whose `get_msg` of a pack lets its write's ack arrive meanwhile
    (the partition calls `own`), for the sequences in `ours`."""

    def __init__(self, js: JetStreamContext, ours: set[int]) -> None:
        self._js = js
        self.ours = ours
        self.late: LateHalves | None = None
        self.fetched: list[int] = []

    async def get_msg(self, stream: str, seq: int) -> Any:
        self.fetched.append(seq)
        if seq in self.ours and self.late is not None:
            self.late.own([seq], op_floor=1)
        return await self._js.get_msg(stream, seq)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)


async def test_the_follower_reads_a_foreign_pack_whole_and_skips_its_own(
    private_nc: Client,
) -> None:
    js = private_nc.jetstream()
    await ensure_log_streams(js, half_retention=3600)
    legacy = await js.publish(layout.half_subject(0), b"alone", headers=written_half("alone"))
    own, foreign = written_pack("own"), written_pack("a", "b")
    acked_meanwhile = await js.publish(own.subject, own.payload, headers=own.headers)
    last = await js.publish(foreign.subject, foreign.payload, headers=foreign.headers)
    found: list[tuple[int, list[tuple[str, int, bytes]]]] = []

    async def collect(seq: int, halves: list[StoredHalf]) -> None:
        found.append((seq, [(h.txid, h.half.index, h.message.body) for h in halves]))

    proxy = AckedMeanwhile(js, {acked_meanwhile.seq})
    late = LateHalves(cast(JetStreamContext, proxy), 0, 0, collect, end=HalfEnd(js, 0, tick=0.01))
    proxy.late = late
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(late.run)
            await eventually(lambda: late.next_seq > last.seq, what="the follower read all")
            tasks.cancel_scope.cancel()
    assert proxy.fetched == [acked_meanwhile.seq, last.seq], "only packs are fetched"
    assert found == [
        (legacy.seq, [("alone", 0, b"")]),  # headers only: its body stays in TXN_HALF
        (last.seq, [("a", 0, b"a:0"), ("a", 1, b"a:1"), ("b", 0, b"b:0"), ("b", 1, b"b:1")]),
    ], "a pack whose ack came while it was read is ours"
    assert late.hold(Checkpoint(last.seq + 5, 1)).half_seq == last.seq + 1


def test_the_checkpoint_never_passes_a_half_not_looked_at() -> None:
    js = cast(JetStreamContext, None)
    late = LateHalves(js, 0, after=41, found=nothing_found, end=HalfEnd(js, 0, tick=0.1))
    ahead = Checkpoint(half_seq=100, op_seq=7)
    assert late.hold(ahead) == Checkpoint(half_seq=42, op_seq=7)
    behind = Checkpoint(half_seq=10, op_seq=7)
    assert late.hold(behind) is behind
    # Its own halves held back with it: their transactions' op records are read again too.
    late.own([50, 60], op_floor=3)
    late.own([70], op_floor=6)
    late.own([30], op_floor=1)  # passed already: not held
    assert late.hold(ahead) == Checkpoint(half_seq=42, op_seq=3)
    assert late.hold(Checkpoint(half_seq=100, op_seq=2)) == Checkpoint(half_seq=42, op_seq=2)
    assert late.hold(behind) is behind


async def test_a_successor_reads_the_decisions_of_the_halves_the_checkpoint_held_back(
    private_nc: Client,
) -> None:
    """The checkpoint waits for the follower (`hold`), which looks at TXN_HALF only now and
    then: held back at a half whose transaction has finished since, it must also go back in
    TXN_OP to that transaction's decision, or a successor starting from it takes the
    transaction for an open one (and checks back a committed transaction, publishes it again,
    or even discards it)."""
    lagging = CoordinatorOptions(tick_interval=1.0, checkpoint_interval=60.0)
    """The follower's first look at TXN_HALF comes 10 s after the start (`FOLLOW_TICKS`)."""
    client = CoordinatorClient(private_nc)
    async with run_coordinator(private_nc, options=lagging) as coordinator:

        def following() -> Any:
            """The partition, once its follower has read the (empty) subject and waits."""
            owned = coordinator.owned.get(0)
            instance = owned.ref._cell._instance if owned and owned.ref else None
            late = instance._late if instance else None
            return instance if late and late._end._look is not None else None

        # Its first read is over before the first half is written: it looks again in 10 s.
        partition = await eventually(following, what="the follower waits")
        late = partition._late
        for n in range(20):
            receipt = await client.prepare(f"t{n}", message())
            await client.end(f"t{n}", receipt.token, Decision.COMMIT)
        await eventually(
            lambda: client.admin(ListTransactions(version=PROTOCOL_VERSION)),
            until=lambda listed: not listed.transactions,
            what="every transaction committed and done",
        )
        # What its next checkpoint save writes (`_save_checkpoints`), held back at the start.
        saved = late.hold(partition.table.checkpoint())
        assert saved.half_seq == 1, "the follower has not looked at TXN_HALF yet"
    kv = await private_nc.jetstream().key_value(layout.CHECKPOINT_BUCKET)
    await save_checkpoint(kv, 0, saved)
    with capture_logs() as logs:
        async with run_coordinator(private_nc, options=OPTIONS):
            listed = await client.admin(ListTransactions(version=PROTOCOL_VERSION))
    [recovered] = [e for e in logs if e["event"] == "coordinator_recovered"]
    assert recovered["open"] == 0, "every transaction read back as finished"
    assert listed.transactions == []
    assert sorted(await topic_ids(private_nc, "orders")) == sorted(f"t{n}:0" for n in range(20))


async def nothing_found(seq: int, halves: list[StoredHalf]) -> None:
    raise AssertionError("nothing is read here")
