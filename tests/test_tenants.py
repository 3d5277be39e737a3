"""Tenants kept apart: a real nats-server with exactly the configuration of docs/operations.md.

The server runs docs/nats-tenants.conf (which docs/operations.md includes verbatim, checked
here); the coordinator runs with its user and a tenant policy (`group_topics`). A producer of
group `orders` commits into its own topic, and can do nothing to group `payments`: not
prepare into its topics, not end its transactions, not see its check-backs; nor touch the
coordinator's streams and buckets, call the admin verbs, or have a stream declared for a
topic it was not given. The operator lists transactions and leases.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client

from tests.conftest import MakeNatsServer
from tests.support.txn import FAST
from txactors import admin, layout
from txactors.actors import RemoteActorRef
from txactors.consumer import ConsumedMessage, Consumer
from txactors.coordinator.config import CoordinatorConfig
from txactors.coordinator.options import CoordinatorOptions
from txactors.coordinator.service import run_coordinator
from txactors.coordinator.validation import Boundary
from txactors.errors import AskTimeout, CommandError, ConfigError, PrepareFailed
from txactors.lease_admin import list_leases
from txactors.partition_count import read_published
from txactors.producer import TransactionProducer, TxMessage
from txactors.protocol import (
    Decision,
    Ended,
    EndTransaction,
    ErrorCode,
    ListTransactions,
    OutgoingMessage,
    Prepare,
    Prepared,
    TransactionList,
)

DOCS = Path(__file__).resolve().parent.parent / "docs"
CONF = DOCS / "nats-tenants.conf"
POLICY = {"orders": ["orders", "orders-*"], "payments": ["payments"]}
"""The coordinator's tenant policy, as docs/operations.md gives it."""
DENIED = 1.0
"""Seconds a request the server refused to route is given to (not) be answered."""


@dataclass
class User:
    nc: Client
    violations: list[str] = field(default_factory=list)
    """The server's permission errors on this connection."""

    async def violation(self, subject: str) -> None:
        """Wait until the server has refused an operation on `subject`."""
        quoted = f'"{subject.lower()}"'  # nats-py hands the server's error on lower-cased
        with anyio.fail_after(5):
            while not any(quoted in v.lower() for v in self.violations):
                await self.nc.flush()
                await anyio.sleep(0.02)


@dataclass
class Deployment:
    coordinator: Client
    users: dict[str, User]

    def __getitem__(self, name: str) -> User:
        return self.users[name]


def _password(user: str) -> str:
    found = re.search(rf'user: {user}, password: "([^"]+)"', CONF.read_text())
    assert found, f"{user} is not in {CONF}"
    return found.group(1)


async def _connect(url: str, user: str, **kwargs: Any) -> User:
    violations: list[str] = []

    async def on_error(error: Exception) -> None:
        violations.append(str(error))

    nc = await nats.connect(url, user=user, password=_password(user), error_cb=on_error, **kwargs)
    return User(nc, violations)


@asynccontextmanager
async def deployed(make_nats_server: MakeNatsServer) -> AsyncIterator[Deployment]:
    """The server with the documented configuration, and the coordinator with its policy
    (entered in the test itself: the coordinator's task group must exit where it began)."""
    server = await make_nats_server(extra_args=["-c", str(CONF)])
    coordinator = await _connect(server.url, "coordinator")
    users = {
        name: await _connect(server.url, name, inbox_prefix=f"_INBOX.{name}")
        for name in ("orders", "payments", "billing")
    }
    users["operator"] = await _connect(server.url, "operator")
    try:
        async with run_coordinator(
            coordinator.nc,
            config=CoordinatorConfig(**FAST),
            options=CoordinatorOptions(group_topics=POLICY, lease_ttl=5.0),
        ) as running:
            with anyio.fail_after(10):  # a lease not free yet at start is taken soon after
                while running.partitions != [0]:
                    await anyio.sleep(0.05)
            yield Deployment(coordinator.nc, users)
    finally:
        for user in (*users.values(), coordinator):
            await user.nc.close()


def _prepare(group: str, topic: str, txid: str = "tenant-tx") -> Prepare:
    message = OutgoingMessage(topic=topic, body=b"x")
    return Prepare(txid=txid, group=group, producer="p1", messages=[message])


async def _stream_exists(deployment: Deployment, name: str) -> bool:
    try:
        await deployment.coordinator.jetstream().stream_info(name)
    except nats.js.errors.NotFoundError:
        return False
    return True


BOUNDARY = Boundary(
    partition=0,
    partitions=1,
    max_messages=10,
    max_immunity=60.0,
    group_topics={g: tuple(ps) for g, ps in POLICY.items()},
)


@pytest.mark.parametrize(
    ("group", "topic", "subject", "code"),
    [
        ("orders", "orders", layout.prepare_subject(0, "orders"), None),
        ("orders", "orders-eu", layout.prepare_subject(0, "orders"), None),
        ("orders", "orders", layout.prepare_subject(0), None),  # deprecated, still policed
        ("orders", "ordersx", layout.prepare_subject(0, "orders"), ErrorCode.FORBIDDEN),
        ("orders", "payments", layout.prepare_subject(0), ErrorCode.FORBIDDEN),
        ("payments", "payments", layout.prepare_subject(0, "orders"), ErrorCode.FORBIDDEN),
        ("intruders", "orders", layout.prepare_subject(0, "intruders"), ErrorCode.FORBIDDEN),
        ("orders", "bad.topic", layout.prepare_subject(0, "payments"), ErrorCode.BAD_REQUEST),
    ],
)
def test_the_boundary_keeps_groups_to_their_subjects_and_topics(
    group: str, topic: str, subject: str, code: ErrorCode | None
) -> None:
    refusal = BOUNDARY.refusal(_prepare(group, topic), max_payload=1 << 20, subject=subject)
    assert (refusal and refusal.code) == code, refusal


def test_without_a_policy_any_group_writes_any_topic_on_its_own_subject() -> None:
    boundary = dataclasses.replace(BOUNDARY, group_topics={})
    own = layout.prepare_subject(0, "x")
    assert boundary.refusal(_prepare("x", "anything"), max_payload=1 << 20, subject=own) is None


@pytest.mark.parametrize(
    "policy", [{"a b": ["t"]}, {"g": ["t.u"]}, {"g": ["t*u"]}, {"g": ["**"]}, {"": ["t"]}]
)
def test_a_malformed_policy_is_refused_at_start(policy: dict[str, list[str]]) -> None:
    with pytest.raises(ConfigError, match="group_topics"):
        CoordinatorOptions(group_topics=policy)


def test_operations_md_gives_exactly_the_configuration_tested() -> None:
    text = (DOCS / "operations.md").read_text()
    assert f"```text\n{CONF.read_text()}```" in text


async def test_a_producer_commits_into_its_own_topic_and_a_consumer_reads_it(
    make_nats_server: MakeNatsServer,
) -> None:
    async with deployed(make_nats_server) as deployment:
        received: list[ConsumedMessage] = []
        got = anyio.Event()

        async def handle(message: ConsumedMessage) -> None:
            received.append(message)
            got.set()

        producer = TransactionProducer(deployment["orders"].nc, "orders", lambda _: Decision.COMMIT)
        consumer = Consumer(deployment["billing"].nc, "orders", "billing", handle)
        async with producer, consumer:
            async with producer.begin() as txn:
                await txn.send(TxMessage("orders", b"order 1"))
            with anyio.fail_after(10):
                await got.wait()
        assert [m.body for m in received] == [b"order 1"]
        assert deployment["orders"].violations == deployment["billing"].violations == []


@pytest.mark.parametrize("topic", ["payments", "secrets"])
async def test_a_topic_outside_the_groups_policy_is_forbidden_and_no_stream_declared(
    make_nats_server: MakeNatsServer, topic: str
) -> None:
    async with deployed(make_nats_server) as deployment:
        producer = TransactionProducer(deployment["orders"].nc, "orders", lambda _: Decision.COMMIT)
        async with producer:
            with pytest.raises(PrepareFailed) as refused:
                async with producer.begin() as txn:
                    await txn.send([TxMessage("orders-eu", b"ok"), TxMessage(topic, b"not yours")])
        assert refused.value.code == ErrorCode.FORBIDDEN
        assert "group_topics" in str(refused.value)
        assert not await _stream_exists(deployment, layout.topic_stream(topic))
        assert not await _stream_exists(deployment, layout.topic_stream("orders-eu"))


async def test_a_group_not_in_the_policy_is_forbidden(make_nats_server: MakeNatsServer) -> None:
    async with deployed(make_nats_server) as deployment:
        # The coordinator's own connection may publish anywhere: the policy still holds.
        ref = RemoteActorRef(
            deployment.coordinator, layout.prepare_subject(0, "intruders"), Prepared
        )
        with pytest.raises(CommandError) as refused:
            await ref.ask(_prepare("intruders", "orders"), timeout=5)
        assert refused.value.code == ErrorCode.FORBIDDEN
        assert "does not list it" in refused.value.message


async def test_a_producer_cannot_prepare_as_another_group(make_nats_server: MakeNatsServer) -> None:
    async with deployed(make_nats_server) as deployment:
        orders = deployment["orders"]
        own = RemoteActorRef(orders.nc, layout.prepare_subject(0, "orders"), Prepared)
        with pytest.raises(CommandError) as refused:
            await own.ask(_prepare("payments", "payments"), timeout=5)
        assert refused.value.code == ErrorCode.FORBIDDEN
        assert "subject of group" in refused.value.message
        for subject in (layout.prepare_subject(0, "payments"), layout.prepare_subject(0)):
            other = RemoteActorRef(orders.nc, subject, Prepared)
            with pytest.raises(AskTimeout):  # the server dropped it: nobody got it
                await other.ask(_prepare("payments", "payments"), timeout=DENIED)
            await orders.violation(subject)
        assert not await _stream_exists(deployment, layout.topic_stream("payments"))


async def test_a_producer_cannot_end_another_groups_transaction(
    make_nats_server: MakeNatsServer,
) -> None:
    async with deployed(make_nats_server) as deployment:
        payments = RemoteActorRef(
            deployment["payments"].nc, layout.prepare_subject(0, "payments"), Prepared
        )
        prepared = await payments.ask(_prepare("payments", "payments", "pay-1"), timeout=5)
        end = EndTransaction(txid="pay-1", token=prepared.token, decision=Decision.ROLLBACK)
        # Even with the token (leaked, say), on its own end subject: forbidden.
        own = RemoteActorRef(deployment["orders"].nc, layout.end_subject(0, "orders"), Ended)
        with pytest.raises(CommandError) as refused:
            await own.ask(end, timeout=5)
        assert refused.value.code == ErrorCode.FORBIDDEN
        other = RemoteActorRef(deployment["orders"].nc, layout.end_subject(0, "payments"), Ended)
        with pytest.raises(AskTimeout):
            await other.ask(end, timeout=DENIED)
        await deployment["orders"].violation(layout.end_subject(0, "payments"))
        listed = await admin.list_transactions(deployment["operator"].nc)
        assert [t.txid for t in listed] == ["pay-1"]  # still open: not rolled back


async def test_a_producer_cannot_touch_the_coordinators_streams_and_buckets(
    make_nats_server: MakeNatsServer,
) -> None:
    async with deployed(make_nats_server) as deployment:
        orders = deployment["orders"]
        js = orders.nc.jetstream(timeout=DENIED)
        for name in (layout.HALF_STREAM, layout.OP_STREAM, "KV_" + layout.LEASE_BUCKET):
            with pytest.raises(nats.errors.TimeoutError):
                await js.stream_info(name)
            await orders.violation(f"$JS.API.STREAM.INFO.{name}")
        with pytest.raises(nats.errors.TimeoutError):
            await js.get_msg(layout.HALF_STREAM, 1)
        with pytest.raises(nats.errors.TimeoutError):
            await js.key_value(layout.CHECKPOINT_BUCKET)
        coordinator = deployment.coordinator.jetstream()
        before = {
            name: (await coordinator.stream_info(name)).state.messages
            for name in (layout.HALF_STREAM, layout.OP_STREAM, "KV_" + layout.LEASE_BUCKET)
        }
        for subject in (layout.half_subject(0), layout.op_subject(0), "$KV.TXN_LEASE.0"):
            await orders.nc.publish(subject, b"forged")
            await orders.violation(subject)
        after = {name: (await coordinator.stream_info(name)).state.messages for name in before}
        assert after == before


async def test_a_producer_reads_the_partition_count_and_nothing_else_of_the_bucket(
    make_nats_server: MakeNatsServer,
) -> None:
    async with deployed(make_nats_server) as deployment:
        orders = deployment["orders"]
        assert await read_published(orders.nc, timeout=5) == 1
        assert await read_published(deployment["operator"].nc, timeout=5) == 1
        other_key = f"$JS.API.DIRECT.GET.KV_{layout.META_BUCKET}.$KV.{layout.META_BUCKET}.x"
        with pytest.raises(nats.errors.TimeoutError):
            await orders.nc.request(other_key, b"", timeout=DENIED)
        await orders.violation(other_key)
        written = f"$KV.{layout.META_BUCKET}.{layout.PARTITIONS_KEY}"
        await orders.nc.publish(written, b"7")
        await orders.violation(written)
        assert await read_published(orders.nc, timeout=5) == 1
        assert deployment["operator"].violations == []


async def test_a_producer_cannot_answer_another_groups_check_backs(
    make_nats_server: MakeNatsServer,
) -> None:
    async with deployed(make_nats_server) as deployment:
        orders, payments = deployment["orders"], deployment["payments"]
        snooped = [
            await orders.nc.subscribe(layout.check_group_subject("payments")),
            await orders.nc.subscribe(layout.check_instance_subject("payments", "p1")),
        ]
        for subject in ("txn.check.payments", "txn.check.payments.p1"):
            await orders.violation(subject)
        checks = await payments.nc.subscribe(layout.check_instance_subject("payments", "p1"))
        prepare = RemoteActorRef(payments.nc, layout.prepare_subject(0, "payments"), Prepared)
        await prepare.ask(_prepare("payments", "payments", "pay-2"), timeout=5)
        with anyio.fail_after(10):  # no end: the coordinator checks back, to payments only
            await checks.next_msg(timeout=10)
        assert [s.pending_msgs for s in snooped] == [0, 0]


async def test_only_the_operator_calls_the_admin_verbs(make_nats_server: MakeNatsServer) -> None:
    async with deployed(make_nats_server) as deployment:
        orders = deployment["orders"]
        ref = RemoteActorRef(orders.nc, layout.admin_subject(0), TransactionList)
        with pytest.raises(AskTimeout):
            await ref.ask(ListTransactions(), timeout=DENIED)
        await orders.violation(layout.admin_subject(0))
        operator = deployment["operator"].nc
        assert await admin.list_transactions(operator) == []
        leases = await list_leases(operator, partitions=1)
        assert [lease.owner is not None for lease in leases.leases] == [True]
        assert deployment["operator"].violations == []
