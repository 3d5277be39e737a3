"""Tenants kept apart: a nats-server run from exactly the documented configuration.

The server runs docs/nats-tenants.conf, copied byte for byte, next to a site file that says
only where it listens and keeps its streams (the lines docs/nats-tenants-site.conf says to
change); nothing else is added, so JetStream, the accounts and every permission come from
the documented file. docs/operations.md includes both verbatim (checked here).

The coordinator runs with its user and the documented policy (`group_topics`,
`consumer_groups`). For every role the positive path works (commit, rollback, check-back,
consume, dead-letter, operator list/show/resolve) and every right not granted is refused:
no role but the coordinator creates, changes or deletes a stream or bucket, reads another
group's halves, ops, prepares, tokens, check-backs or topics, or gets an answer aimed into
another group's inbox.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
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
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.js.api import StreamConfig

from tests.support.txn import FAST
from tests.support.wait import eventually
from txactors.actors import RemoteActorRef
from txactors.consumer import ConsumedMessage, Consumer
from txactors.coordinator.boundary import Boundary
from txactors.coordinator.options import CoordinatorOptions
from txactors.coordinator.partition.tenants import TenantReplies
from txactors.coordinator.service import run_coordinator
from txactors.embedded.cluster import free_ports
from txactors.embedded.setup import find_nats_server_binary
from txactors.errors import (
    ActorDeadError,
    AskTimeout,
    CommandError,
    ConfigError,
    PoisonMessage,
    PrepareFailed,
)
from txactors.nats.config import NatsConfig
from txactors.nats.connect import connect_options
from txactors.nats.partition_count import read_published
from txactors.ops import txn as admin
from txactors.ops.leases import list_leases
from txactors.producer import TransactionProducer, TxMessage
from txactors.wire import layout
from txactors.wire.protocol import (
    PROTOCOL_VERSION,
    Decision,
    Ended,
    EndTransaction,
    ErrorCode,
    ListTransactions,
    OutgoingMessage,
    Prepare,
    Prepared,
    TransactionList,
    encode,
)
from txactors.wire.rules import CoordinatorConfig

DOCS = Path(__file__).resolve().parents[2] / "docs"
CONF = DOCS / "nats-tenants.conf"
SITE = DOCS / "nats-tenants-site.conf"
POLICY = {"orders": ["orders", "orders-*"], "payments": ["payments"]}
"""The coordinator's tenant policy, as docs/operations.md gives it."""
CONSUMERS = {"billing": ["orders"]}
"""The consumer groups whose streams the coordinator declares, as docs/operations.md says."""
DENIED = 1.0
"""Seconds a request the server refused to route is given to (not) be answered."""
STREAMS = (
    layout.topic_stream("orders"),
    layout.topic_stream("payments"),
    layout.dlq_stream("billing"),
    layout.half_stream(0),
    layout.op_stream(0),
    layout.DISCARD_STREAM,
    "KV_" + layout.LEASE_BUCKET,
    "KV_" + layout.CHECKPOINT_BUCKET,
)
"""Every stream of the deployment (the topic streams once both groups have prepared)."""


@dataclass
class User:
    nc: Client
    violations: list[str] = field(default_factory=list)
    """The server's permission errors on this connection."""

    async def violation(self, subject: str) -> None:
        """Wait until the server has refused an operation on `subject`."""
        quoted = f'"{subject.lower()}"'  # nats-py hands the server's error on lower-cased

        async def refused() -> bool:
            await self.nc.flush()
            return any(quoted in v.lower() for v in self.violations)

        await eventually(refused, timeout=5, what=f"a violation on {subject}")

    async def refused(self, subject: str, payload: bytes = b"{}") -> None:
        """Publish `subject` as a request (any answer would come to our inbox) and wait for
        the server's refusal."""
        await self.nc.publish(subject, payload, reply=self.nc.new_inbox())
        await self.violation(subject)


@dataclass
class Deployment:
    url: str
    coordinator: Client
    users: dict[str, User]

    def __getitem__(self, name: str) -> User:
        return self.users[name]

    async def configs(self) -> dict[str, Any]:
        """Every stream's configuration, as the coordinator sees it."""
        js = self.coordinator.jetstream()
        found: dict[str, Any] = {}
        for name in STREAMS:
            try:
                found[name] = (await js.stream_info(name)).config.as_dict()
            except nats.js.errors.NotFoundError:
                found[name] = None
        return found


def _password(user: str) -> str:
    found = re.search(rf'user: {user}, password: "([^"]+)"', CONF.read_text())
    assert found, f"{user} is not in {CONF}"
    return found.group(1)


def site_file(port: int, store: Path) -> str:
    """docs/nats-tenants-site.conf with its two lines set to this test's port and store."""
    text = SITE.read_text()
    text, listens = re.subn(r"(?m)^listen: .*$", f"listen: 127.0.0.1:{port}", text)
    text, stores = re.subn(r'(?m)^store_dir: ".*"$', f'store_dir: "{store}"', text)
    assert (listens, stores) == (1, 1), "the site file's lines to change are not as documented"
    return text


def write_deployment(directory: Path) -> tuple[Path, int]:
    """A copy of docs/nats-tenants.conf and its site file in `directory`; the copy's path
    and the port it listens on."""
    directory.mkdir()
    conf = directory / CONF.name
    shutil.copyfile(CONF, conf)
    (port,) = free_ports("127.0.0.1", 1)
    (directory / SITE.name).write_text(site_file(port, directory / "store"))
    return conf, port


@asynccontextmanager
async def documented_server(directory: Path) -> AsyncIterator[str]:
    """nats-server -c <copy of docs/nats-tenants.conf>, with the site file beside it; ready
    once its own log says so (a port probe could reach another test's server)."""
    conf, port = write_deployment(directory)
    binary = str(find_nats_server_binary())
    process = await anyio.open_process(
        [binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    log = bytearray()
    ready = anyio.Event()

    async def read_log() -> None:  # read to the end: a full pipe would stall the server
        assert process.stderr is not None
        async for chunk in process.stderr:
            log.extend(chunk)
            if b"Server is ready" in log:
                ready.set()
        ready.set()

    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(read_log)
            with anyio.fail_after(10):
                await ready.wait()
            assert b"Server is ready" in log, log.decode(errors="replace")
            assert f"Listening for client connections on 127.0.0.1:{port}".encode() in log
            assert b"Starting JetStream" in log
            yield f"nats://127.0.0.1:{port}"
            tasks.cancel_scope.cancel()
    finally:
        process.terminate()
        with anyio.move_on_after(10) as waiting:
            await process.wait()
        if waiting.cancelled_caught:
            process.kill()
            await process.wait()
        await process.aclose()


async def _connect(url: str, user: str, *, inbox: bool = True) -> User:
    """`user`'s connection as txactors makes it from the environment the docs give it
    (NATS_USER, NATS_PASSWORD, and NATS_INBOX_PREFIX=_INBOX.<user> unless `inbox` is False)."""
    violations: list[str] = []

    async def on_error(error: Exception) -> None:
        violations.append(str(error))

    environ = {"NATS_URL": url, "NATS_USER": user, "NATS_PASSWORD": _password(user)}
    if inbox:
        environ["NATS_INBOX_PREFIX"] = f"_INBOX.{user}"
    options = connect_options(NatsConfig.from_env(environ))
    nc = await nats.connect(url, error_cb=on_error, **options)
    return User(nc, violations)


@asynccontextmanager
async def deployed(tmp_path: Path, **options: Any) -> AsyncIterator[Deployment]:
    """The server with the documented configuration, and the coordinator with its policy."""
    async with documented_server(tmp_path / "nats") as url:
        coordinator = await _connect(url, "coordinator", inbox=False)
        users = {
            name: await _connect(url, name)
            for name in ("orders", "payments", "billing", "operator")
        }
        settings = {"group_topics": POLICY, "consumer_groups": CONSUMERS, "lease_ttl": 5.0}
        try:
            async with run_coordinator(
                coordinator.nc,
                config=CoordinatorConfig(**FAST),
                options=CoordinatorOptions(**{**settings, **options}),
            ) as running:
                await eventually(  # a lease not free yet at start is taken soon after
                    lambda: running.partitions == [0], what="partition 0 served"
                )
                for group in ("orders", "payments"):
                    await _served(users[group].nc, group)
                yield Deployment(url, coordinator.nc, users)
        finally:
            for user in (*users.values(), coordinator):
                await user.nc.close()


async def _served(nc: Client, group: str) -> None:
    """Wait until the group's prepares reach the coordinator: a nats-server freshly started
    may answer "no responders" for a few milliseconds after the coordinator subscribed and
    flushed. Asked with an empty txid, which the boundary refuses before anything is done."""
    ref = RemoteActorRef(nc, layout.prepare_subject(0, group), Prepared)

    async def refused() -> CommandError | None:
        try:
            await ref.ask(_prepare(group, group, txid=""), timeout=5)
        except CommandError as error:
            return error
        return None

    error = await eventually(refused, ignoring=(ActorDeadError,), what=f"{group}'s prepares served")
    assert error.code == ErrorCode.BAD_REQUEST, error


def _prepare(group: str, topic: str, txid: str = "tenant-tx") -> Prepare:
    message = OutgoingMessage(topic=topic, body=b"x")
    return Prepare(
        txid=txid, group=group, producer="p1", messages=[message], version=PROTOCOL_VERSION
    )


async def _stream_exists(deployment: Deployment, name: str) -> bool:
    try:
        await deployment.coordinator.jetstream().stream_info(name)
    except nats.js.errors.NotFoundError:
        return False
    return True


# -- the documented files ----------------------------------------------------------------------


def test_operations_md_gives_exactly_the_configuration_tested() -> None:
    text = (DOCS / "operations.md").read_text()
    assert f"```text\n{CONF.read_text()}```" in text
    assert f"```text\n{SITE.read_text()}```" in text


def test_the_site_file_holds_only_the_lines_to_change() -> None:
    lines = [line for line in SITE.read_text().splitlines() if not line.startswith("#")]
    assert [line.split(":")[0] for line in lines] == ["listen", "store_dir"]
    assert f'include "{SITE.name}"' in CONF.read_text()


# -- the boundary and the reply rule, without a server -----------------------------------------

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
        ("orders", "ordersx", layout.prepare_subject(0, "orders"), ErrorCode.FORBIDDEN),
        ("orders", "payments", layout.prepare_subject(0, "orders"), ErrorCode.FORBIDDEN),
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


@pytest.mark.parametrize(
    ("known", "subject", "code"),
    [
        ("orders", layout.end_subject(0, "orders"), None),
        (None, layout.end_subject(0, "payments"), None),  # unknown here: answered not_found later
        ("orders", layout.end_subject(0, "payments"), ErrorCode.FORBIDDEN),
    ],
)
def test_the_boundary_keeps_an_end_to_its_transactions_group_subject(
    known: str | None, subject: str, code: ErrorCode | None
) -> None:
    """The same policy as a prepare's, for an end: the group its subject names must be the
    transaction's, without telling the sender which group that is."""
    end = EndTransaction(
        txid="tenant-tx", token="0" * 32, decision=Decision.COMMIT, version=PROTOCOL_VERSION
    )
    refusal = BOUNDARY.refusal(
        end, max_payload=1 << 20, subject=subject, group_of=lambda txid: known
    )
    assert (refusal and refusal.code) == code, refusal
    if refusal is not None:
        assert "orders" not in refusal.message


@pytest.mark.parametrize(
    ("group", "topic", "rules"),
    [
        ("orders", "orders", ()),
        ("orders", "orders-eu", ("orders-*",)),
        ("payments", "payments", ()),
        ("unlisted", "orders-eu", ()),
    ],
)
def test_only_topics_allowed_by_a_prefix_rule_count_against_its_cap(
    group: str, topic: str, rules: tuple[str, ...]
) -> None:
    assert BOUNDARY.prefix_rules(group, topic) == rules


def test_without_a_policy_any_group_writes_any_topic_on_its_own_subject() -> None:
    boundary = dataclasses.replace(BOUNDARY, group_topics={})
    own = layout.prepare_subject(0, "x")
    assert boundary.refusal(_prepare("x", "anything"), max_payload=1 << 20, subject=own) is None
    assert boundary.prefix_rules("x", "anything") == ()


@pytest.mark.parametrize(
    "options",
    [
        {"group_topics": {"a b": ["t"]}},
        {"group_topics": {"g": ["t.u"]}},
        {"group_topics": {"g": ["t*u"]}},
        {"group_topics": {"g": ["**"]}},
        {"group_topics": {"": ["t"]}},
        {"consumer_groups": {"g": ["t*"]}},
        {"consumer_groups": {"g.h": ["t"]}},
        {"max_prefix_topics": 0},
    ],
)
def test_a_malformed_policy_is_refused_at_start(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=next(iter(options))):
        CoordinatorOptions(**options)


GROUP = st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True)
REPLIES = TenantReplies("_INBOX.", ["orders", "payments", "billing"])


@given(group=GROUP, owner=GROUP, rest=GROUP, partition=st.integers(0, 9))
def test_a_groups_request_is_answered_only_in_its_own_inbox(
    group: str, owner: str, rest: str, partition: int
) -> None:
    reply = f"_INBOX.{owner}.{rest}"
    for subject in (layout.prepare_subject(partition, group), layout.end_subject(partition, group)):
        assert (REPLIES(subject, reply) is None) == (owner == group)


@given(owner=GROUP, rest=GROUP)
def test_admin_answers_never_go_into_a_tenants_inbox(owner: str, rest: str) -> None:
    reply = f"_INBOX.{owner}.{rest}"
    tenant = owner in ("orders", "payments", "billing")
    assert (REPLIES(layout.admin_subject(0), reply) is None) == (not tenant)


# -- the documented deployment -----------------------------------------------------------------


async def test_commit_rollback_check_back_consume_and_dead_letter(tmp_path: Path) -> None:
    async with deployed(tmp_path) as deployment:
        received: list[bytes] = []
        enough = anyio.Event()

        async def handle(message: ConsumedMessage) -> None:
            received.append(message.body)
            if len(received) == 3:
                enough.set()
            if message.body == b"poison":
                raise PoisonMessage("not for billing")

        producer = TransactionProducer(deployment["orders"].nc, "orders", lambda _: Decision.COMMIT)
        consumer = Consumer(
            deployment["billing"].nc, "orders", "billing", handle, declare_streams=False
        )
        async with producer, consumer:
            async with producer.begin() as txn:
                await txn.send(TxMessage("orders", b"committed"))
            rolled_back = producer.begin()
            async with rolled_back:
                await rolled_back.send(TxMessage("orders", b"rolled back"))
                await rolled_back.rollback()
            checked = producer.begin()
            async with checked:  # no end: the check-back asks the checker, which commits
                await checked.send(TxMessage("orders", b"checked back"))
                await checked.leave_unknown()
            async with producer.begin() as txn:
                await txn.send(TxMessage("orders", b"poison"))
            with anyio.fail_after(15):
                await enough.wait()
        assert sorted(received) == [b"checked back", b"committed", b"poison"]
        dead = (
            await deployment["operator"]
            .nc.jetstream()
            .get_last_msg(layout.dlq_stream("billing"), layout.dlq_subject("billing", "orders"))
        )  # stored before the consumer stopped: it dead-letters before it acks
        assert dead.data == b"poison"
        for role in ("orders", "billing"):
            assert deployment[role].violations == [], role


async def test_the_operator_lists_shows_and_resolves(tmp_path: Path) -> None:
    async with deployed(tmp_path) as deployment:
        payments = RemoteActorRef(
            deployment["payments"].nc, layout.prepare_subject(0, "payments"), Prepared
        )
        await payments.ask(_prepare("payments", "payments", "pay-op"), timeout=5)
        operator = deployment["operator"].nc
        assert [t.txid for t in await admin.list_transactions(operator)] == ["pay-op"]
        assert (await admin.show(operator, "pay-op")).group == "payments"
        ended = await admin.commit(operator, "pay-op")
        assert ended.state == "committed"
        stored = await operator.jetstream().get_last_msg(
            layout.topic_stream("payments"), layout.topic_subject("payments")
        )
        assert stored.data == b"x"
        leases = await list_leases(operator, partitions=1)
        assert [lease.owner is not None for lease in leases.leases] == [True]
        assert deployment["operator"].violations == []


async def test_the_consumer_can_create_change_or_delete_no_stream(tmp_path: Path) -> None:
    async with deployed(tmp_path) as deployment:
        for group in ("orders", "payments"):
            prepare = RemoteActorRef(
                deployment[group].nc, layout.prepare_subject(0, group), Prepared
            )
            await prepare.ask(_prepare(group, group, f"{group}-1"), timeout=5)
        before = await deployment.configs()
        assert all(before.values()), before
        billing = deployment["billing"]
        stealing = {
            # copy another group's halves, or its committed messages, into its own stream
            "sources": {
                "name": layout.topic_stream("orders"),
                "subjects": [layout.topic_filter("orders")],
                "sources": [{"name": layout.half_stream(0)}, {"name": "TOPIC_payments"}],
            },
            # capture another group's prepares (their tokens) and check-backs
            "subjects": {
                "name": layout.dlq_stream("billing"),
                "subjects": [
                    layout.dlq_filter("billing"),
                    "txn.coord.*.prepare.payments",
                    "txn.check.payments.>",
                ],
            },
            # delete committed messages for every consumer group
            "limits": {
                "name": layout.topic_stream("orders"),
                "subjects": [layout.topic_filter("orders")],
                "max_msgs": 1,
            },
        }
        for name in STREAMS:
            for verb in ("CREATE", "UPDATE"):
                for config in stealing.values():
                    body = json.dumps({**config, "name": name}).encode()
                    await billing.refused(f"$JS.API.STREAM.{verb}.{name}", body)
            for verb in ("DELETE", "PURGE", "MSG.DELETE", "MSG.GET"):
                await billing.refused(f"$JS.API.STREAM.{verb}.{name}")
            await billing.refused(f"$JS.API.DIRECT.GET.{name}")
            await billing.refused(f"$JS.API.CONSUMER.CREATE.{name}.spy")
            if name not in (layout.topic_stream("orders"), layout.dlq_stream("billing")):
                await billing.refused(f"$JS.API.STREAM.INFO.{name}")
        for subject in (
            "$JS.API.STREAM.CREATE.TOPIC_orders-eu",
            "$JS.API.STREAM.NAMES",
            "$JS.API.CONSUMER.CREATE.TOPIC_orders.billing",  # any filter, or none
            "$JS.API.CONSUMER.CREATE.TOPIC_orders.billing.txn.half.>",
            "$JS.API.CONSUMER.CREATE.TOPIC_orders.other.topic.orders.>",
            "$JS.API.CONSUMER.DURABLE.CREATE.TOPIC_orders.billing",
            "$JS.API.CONSUMER.DELETE.TOPIC_orders.billing",
            "$JS.API.CONSUMER.CREATE.TOPIC_payments.billing.topic.payments.>",
            "$JS.API.CONSUMER.MSG.NEXT.TOPIC_payments.billing",
            "$KV.TXN_LEASE.0",
            layout.topic_subject("orders"),
            layout.half_subject(0),
            layout.prepare_subject(0, "billing"),
            layout.admin_subject(0),
            layout.dlq_subject("payments", "orders"),
        ):
            await billing.refused(subject)
        for subject in ("txn.>", "topic.>", "dlq.>", "_INBOX.orders.>", "$JS.>"):
            await billing.nc.subscribe(subject)
            await billing.violation(subject)
        # and the stream-changing verbs of the no-longer-granted kind, with its own name
        with pytest.raises(nats.errors.TimeoutError):
            await billing.nc.jetstream(timeout=DENIED).add_stream(
                StreamConfig(name="TOPIC_orders", subjects=["topic.orders.>"], max_msgs=1)
            )
        assert await deployment.configs() == before


async def test_producers_and_the_operator_create_change_or_delete_no_stream(
    tmp_path: Path,
) -> None:
    async with deployed(tmp_path) as deployment:
        before = await deployment.configs()
        for role in ("orders", "operator"):
            user = deployment[role]
            for name in STREAMS:
                for verb in ("CREATE", "UPDATE", "DELETE", "PURGE", "MSG.DELETE"):
                    await user.refused(f"$JS.API.STREAM.{verb}.{name}")
                await user.refused(f"$JS.API.CONSUMER.CREATE.{name}.spy")
            for subject in (
                layout.topic_subject("orders"),
                layout.half_subject(0),
                layout.op_subject(0),
                "$KV.TXN_LEASE.0",
                "$KV.TXN_CHECKPOINT.0",
                layout.dlq_subject("billing", "orders"),
            ):
                await user.refused(subject)
        for subject in ("$JS.API.STREAM.INFO.TXN_HALF", "$JS.API.STREAM.MSG.GET.TXN_HALF"):
            await deployment["orders"].refused(subject)
        for subject in (layout.prepare_subject(0, "orders"), layout.end_subject(0, "orders")):
            await deployment["operator"].refused(subject)
        subscriptions = {
            "orders": ["txn.>", "topic.>", "dlq.>", "$KV.>", "$JS.>", "_INBOX.payments.>"],
            "operator": ["txn.>", "topic.>", "_INBOX.orders.>", "_INBOX.>"],
        }
        for role, subjects in subscriptions.items():
            for subject in subjects:
                await deployment[role].nc.subscribe(subject)
                await deployment[role].violation(subject)
        assert await deployment.configs() == before


async def test_a_prefix_rule_makes_at_most_its_cap_of_streams(tmp_path: Path) -> None:
    async with deployed(tmp_path, max_prefix_topics=2) as deployment:
        ref = RemoteActorRef(deployment["orders"].nc, layout.prepare_subject(0, "orders"), Prepared)
        for i, topic in enumerate(["orders-a", "orders-b", "orders-a", "orders"]):
            await ref.ask(_prepare("orders", topic, f"cap-{i}"), timeout=5)
        with pytest.raises(CommandError) as refused:
            await ref.ask(_prepare("orders", "orders-c", "cap-c"), timeout=5)
        assert refused.value.code == ErrorCode.FORBIDDEN
        assert "orders-*" in refused.value.message
        assert "max_prefix_topics" in refused.value.message
        assert not await _stream_exists(deployment, layout.topic_stream("orders-c"))
        listed = await admin.list_transactions(deployment["operator"].nc)
        assert "cap-c" not in {t.txid for t in listed}


@pytest.mark.parametrize("topic", ["payments", "secrets"])
async def test_a_topic_outside_the_groups_policy_is_forbidden_and_no_stream_declared(
    tmp_path: Path, topic: str
) -> None:
    async with deployed(tmp_path) as deployment:
        producer = TransactionProducer(deployment["orders"].nc, "orders", lambda _: Decision.COMMIT)
        async with producer:
            with pytest.raises(PrepareFailed) as refused:
                async with producer.begin() as txn:
                    await txn.send([TxMessage("orders-eu", b"ok"), TxMessage(topic, b"not yours")])
        assert refused.value.code == ErrorCode.FORBIDDEN
        assert "group_topics" in str(refused.value)
        assert not await _stream_exists(deployment, layout.topic_stream(topic))
        assert not await _stream_exists(deployment, layout.topic_stream("orders-eu"))


async def test_a_group_not_in_the_policy_is_forbidden(tmp_path: Path) -> None:
    async with deployed(tmp_path) as deployment:
        # The coordinator's own connection may publish anywhere: the policy still holds.
        async with await nats.connect(
            deployment.url,
            user="coordinator",
            password=_password("coordinator"),
            inbox_prefix="_INBOX.intruders",
        ) as nc:
            ref = RemoteActorRef(nc, layout.prepare_subject(0, "intruders"), Prepared)
            with pytest.raises(CommandError) as refused:
                await ref.ask(_prepare("intruders", "orders"), timeout=5)
        assert refused.value.code == ErrorCode.FORBIDDEN
        assert "does not list it" in refused.value.message


async def test_answers_stay_in_the_groups_inbox(tmp_path: Path) -> None:
    async with deployed(tmp_path) as deployment:
        orders, payments = deployment["orders"], deployment["payments"]
        snooped = await payments.nc.subscribe("_INBOX.payments.>")
        await payments.nc.flush()
        requests = [
            (orders.nc, layout.prepare_subject(0, "orders"), _prepare("orders", "orders", "o-1")),
            (
                deployment["operator"].nc,
                layout.admin_subject(0),
                ListTransactions(version=PROTOCOL_VERSION),
            ),
        ]
        for nc, subject, command in requests:
            await nc.publish(subject, encode(command), reply="_INBOX.payments.aimed")
            await nc.flush()
        # The coordinator's own connection, with the default inbox, on a group's subject:
        # not answered either (it is not under `_INBOX.orders.`).
        ref = RemoteActorRef(deployment.coordinator, layout.prepare_subject(0, "orders"), Prepared)
        with pytest.raises(AskTimeout):
            await ref.ask(_prepare("orders", "orders", "o-2"), timeout=DENIED)
        with pytest.raises(nats.errors.TimeoutError):
            await snooped.next_msg(timeout=DENIED)
        listed = await admin.list_transactions(deployment["operator"].nc)
        assert listed == []  # refused unexecuted: nothing was prepared


async def test_a_producer_cannot_prepare_as_another_group(tmp_path: Path) -> None:
    async with deployed(tmp_path) as deployment:
        orders = deployment["orders"]
        own = RemoteActorRef(orders.nc, layout.prepare_subject(0, "orders"), Prepared)
        with pytest.raises(CommandError) as refused:
            await own.ask(_prepare("payments", "payments"), timeout=5)
        assert refused.value.code == ErrorCode.FORBIDDEN
        assert "subject of group" in refused.value.message
        for subject in (layout.prepare_subject(0, "payments"), "txn.coord.0.prepare"):
            other = RemoteActorRef(orders.nc, subject, Prepared)
            with pytest.raises(AskTimeout):  # the server dropped it: nobody got it
                await other.ask(_prepare("payments", "payments"), timeout=DENIED)
            await orders.violation(subject)
        assert not await _stream_exists(deployment, layout.topic_stream("payments"))


async def test_a_producer_cannot_end_another_groups_transaction(tmp_path: Path) -> None:
    async with deployed(tmp_path) as deployment:
        payments = RemoteActorRef(
            deployment["payments"].nc, layout.prepare_subject(0, "payments"), Prepared
        )
        prepared = await payments.ask(_prepare("payments", "payments", "pay-1"), timeout=5)
        end = EndTransaction(
            txid="pay-1", token=prepared.token, decision=Decision.ROLLBACK, version=PROTOCOL_VERSION
        )
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
    tmp_path: Path,
) -> None:
    async with deployed(tmp_path) as deployment:
        orders = deployment["orders"]
        js = orders.nc.jetstream(timeout=DENIED)
        for name in (layout.half_stream(0), layout.op_stream(0), "KV_" + layout.LEASE_BUCKET):
            with pytest.raises(nats.errors.TimeoutError):
                await js.stream_info(name)
            await orders.violation(f"$JS.API.STREAM.INFO.{name}")
        with pytest.raises(nats.errors.TimeoutError):
            await js.get_msg(layout.half_stream(0), 1)
        with pytest.raises(nats.errors.TimeoutError):
            await js.key_value(layout.CHECKPOINT_BUCKET)
        coordinator = deployment.coordinator.jetstream()
        before = {
            name: (await coordinator.stream_info(name)).state.messages
            for name in (layout.half_stream(0), layout.op_stream(0), "KV_" + layout.LEASE_BUCKET)
        }
        for subject in (layout.half_subject(0), layout.op_subject(0), "$KV.TXN_LEASE.0"):
            await orders.nc.publish(subject, b"forged")
            await orders.violation(subject)
        after = {name: (await coordinator.stream_info(name)).state.messages for name in before}
        assert after == before


async def test_a_producer_reads_the_partition_count_and_nothing_else_of_the_bucket(
    tmp_path: Path,
) -> None:
    async with deployed(tmp_path) as deployment:
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


async def test_a_producer_cannot_answer_another_groups_check_backs(tmp_path: Path) -> None:
    async with deployed(tmp_path) as deployment:
        orders, payments = deployment["orders"], deployment["payments"]
        snooped = [
            await orders.nc.subscribe(layout.check_group_subject("payments")),
            await orders.nc.subscribe(layout.check_instance_subject("payments", "p1")),
            await orders.nc.subscribe("_INBOX.payments.>"),
        ]
        for subject in ("txn.check.payments", "txn.check.payments.p1", "_INBOX.payments.>"):
            await orders.violation(subject)
        checks = await payments.nc.subscribe(layout.check_instance_subject("payments", "p1"))
        prepare = RemoteActorRef(payments.nc, layout.prepare_subject(0, "payments"), Prepared)
        await prepare.ask(_prepare("payments", "payments", "pay-2"), timeout=5)
        with anyio.fail_after(10):  # no end: the coordinator checks back, to payments only
            await checks.next_msg(timeout=10)
        assert [s.pending_msgs for s in snooped] == [0, 0, 0]


async def test_only_the_operator_calls_the_admin_verbs(tmp_path: Path) -> None:
    async with deployed(tmp_path) as deployment:
        for role in ("orders", "billing"):
            user = deployment[role]
            ref = RemoteActorRef(user.nc, layout.admin_subject(0), TransactionList)
            with pytest.raises(AskTimeout):
                await ref.ask(ListTransactions(version=PROTOCOL_VERSION), timeout=DENIED)
            await user.violation(layout.admin_subject(0))
        assert await admin.list_transactions(deployment["operator"].nc) == []


async def test_a_consumer_pushing_its_messages_at_the_coordinator_acts_for_nobody(
    tmp_path: Path,
) -> None:
    """What the consumer's one create right still allows: its durable as a push consumer
    delivering where it likes. Even with a body its topic's producer wrote as a prepare of
    another group, delivered on that group's subject, the coordinator carries nothing out: the
    reply subject JetStream sets is no inbox."""
    async with deployed(tmp_path) as deployment:
        forged = _prepare("payments", "payments", "forged-1")
        producer = TransactionProducer(deployment["orders"].nc, "orders", lambda _: Decision.COMMIT)
        async with producer, producer.begin() as txn:
            await txn.send(TxMessage("orders", encode(forged)))
        target = layout.prepare_subject(0, "payments")
        seen = await deployment.coordinator.subscribe(target)
        push = {
            "stream_name": "TOPIC_orders",
            "config": {
                "name": "billing",
                "durable_name": "billing",
                "filter_subject": "topic.orders.>",
                "deliver_subject": target,
                "ack_policy": "none",
                "deliver_policy": "all",
            },
        }
        subject = "$JS.API.CONSUMER.CREATE.TOPIC_orders.billing.topic.orders.>"
        await deployment["billing"].nc.request(subject, json.dumps(push).encode(), timeout=5)
        delivered = await seen.next_msg(timeout=5)
        assert delivered.reply.startswith("$JS.ACK.")
        await deployment.coordinator.flush()
        operator = deployment["operator"].nc
        listed = await admin.list_transactions(operator)
        assert "forged-1" not in {t.txid for t in listed}
        assert not await _stream_exists(deployment, layout.topic_stream("payments"))
