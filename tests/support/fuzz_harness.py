"""Sending fuzz inputs at a real coordinator, and the invariants that must hold afterwards.

The harness owns the test's view of the bus: a `Ledger` of what each transaction was allowed
to publish, a `Probe` that runs a normal transaction on every partition through the public
Producer/Consumer API, a fake producer that answers check-backs with garbage, and spies on
the subjects a reply must never reach. Each invariant is a named function returning the
problems it found (empty: it holds), so a failing batch reports every broken rule at once.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from tests.support.coordinator_process import CoordinatorProcess
from tests.support.fuzz_inputs import (
    JSON,
    PROBE_GROUP,
    PROTOCOL_VERSION,
    CheckAnswer,
    Expect,
    Flow,
    FuzzInput,
    RawFrame,
    Request,
    Verdict,
    encode_json,
    hostile_replies,
)
from tests.support.rawnats import raw_hpub
from tests.support.wait import eventually
from txactors.consumer import ConsumedMessage, Consumer
from txactors.coordinator.partition.recovery import read_subject
from txactors.producer import CheckView, Decision, TransactionProducer, TxMessage
from txactors.wire import layout
from txactors.wire.protocol import (
    CheckTransaction,
    Ended,
    EndedBatch,
    Error,
    ErrorCode,
    Prepared,
    PreparedBatch,
    TransactionInfo,
    TransactionList,
)

PROBE_TOPIC = "probe"
REPLY_TIMEOUT = 3.0
"""Seconds a request may wait for its answer (the coordinator answers in milliseconds)."""
PROBE_DEADLINE = 10.0
RECOVERY_DEADLINE = 20.0
"""A restarted coordinator must serve every partition again within this (lease TTL is 2 s)."""

Reply = Error | Prepared | Ended | TransactionList | TransactionInfo | PreparedBatch | EndedBatch
_reply_msgpack = msgspec.msgpack.Decoder(Reply)
_reply_json = msgspec.json.Decoder(Reply)
_check = msgspec.msgpack.Decoder(CheckTransaction)


def decode_reply(data: bytes) -> Reply | None:
    """A protocol reply in either encoding, or None: how a leaked reply is recognised."""
    for decoder in (_reply_msgpack, _reply_json):
        try:
            reply: Reply = decoder.decode(data)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            continue
        return reply
    return None


def header(msg: Msg, name: str) -> str | None:
    """A header as text (nats-py may hand a non-ASCII value back as an email Header)."""
    value = (msg.headers or {}).get(name)
    return None if value is None else str(value)


# -- what was allowed to reach a topic --------------------------------------------------------


@dataclass
class Ledger:
    """Per txid: the (topic, body) pairs the coordinator stored, whether anyone with the right
    to commit it asked for a commit, and which accepted transactions must arrive intact."""

    stored: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    may_commit: set[str] = field(default_factory=set)
    must_arrive: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def store(self, txid: str, messages: list[dict[str, Any]]) -> None:
        self.stored.setdefault(txid, []).extend(messages)

    def allows(self, txid: str | None, topic: str, body: bytes) -> bool:
        if txid is None or txid not in self.may_commit:
            return False
        return any(m["topic"] == topic and m["body"] == body for m in self.stored.get(txid, []))


# -- the probe: a normal transaction on every partition ---------------------------------------


class Probe:
    """One real producer and one real consumer of PROBE_TOPIC: the user's view of health."""

    def __init__(self, nc: Client, ledger: Ledger, partitions: int) -> None:
        self.nc = nc
        self.ledger = ledger
        self.partitions = partitions
        self.received: set[str] = set()
        self.committed: set[str] = set()

        async def commit_known(view: CheckView) -> Decision:
            return Decision.COMMIT if view.txid in ledger.may_commit else Decision.ROLLBACK

        async def record(message: ConsumedMessage) -> None:
            self.received.add(message.msg_id)

        self.producer = TransactionProducer(
            nc, PROBE_GROUP, commit_known, partitions=partitions, request_timeout=REPLY_TIMEOUT
        )
        self.consumer = Consumer(nc, PROBE_TOPIC, "probe-readers", record, pull_expires=0.5)

    async def transaction_on(self, partition: int) -> str | None:
        """Prepare, commit and consume one message on `partition`; the problem, or None."""
        txn = self.producer.begin()
        while layout.partition_of(txn.txid, self.partitions) != partition:
            txn = self.producer.begin()
        body = f"probe {txn.txid}".encode()
        self.ledger.store(txn.txid, [{"topic": PROBE_TOPIC, "body": body}])
        self.ledger.may_commit.add(txn.txid)
        try:
            with anyio.fail_after(PROBE_DEADLINE):
                await txn.send(TxMessage(PROBE_TOPIC, body))
                result = await txn.commit()
                if result.state != "committed":
                    return f"partition {partition}: probe commit answered {result.state!r}"
                self.committed.add(f"{txn.txid}:0")
                await eventually(
                    lambda: f"{txn.txid}:0" in self.received,
                    timeout=math.inf,  # bounded by the probe's deadline above
                    what="the probe consumed",
                )
        except TimeoutError:
            return f"partition {partition}: probe transaction not consumed in {PROBE_DEADLINE}s"
        except Exception as error:
            return f"partition {partition}: probe transaction failed: {error!r}"
        return None


# -- hostile-reply spies and the fake producer --------------------------------------------------


class Spies:
    """Core subscriptions on every subject a reply must never reach."""

    def __init__(self) -> None:
        self.leaks: list[str] = []
        self._subs: list[Subscription] = []

    async def start(self, nc: Client, partitions: int) -> None:
        for subject in hostile_replies(partitions, PROBE_TOPIC):

            async def seen(msg: Msg, subject: str = subject) -> None:
                reply = decode_reply(msg.data)
                # A record the coordinator wrote: a committed message (Txn-Id) or a half.
                ours = header(msg, layout.TXID_HEADER) or header(msg, layout.TOKEN_HEADER)
                if subject.startswith("$JS.") or (reply is not None and not ours):
                    self.leaks.append(f"a reply was published to {subject}: {msg.data[:80]!r}")

            self._subs.append(await nc.subscribe(subject, cb=seen))

    async def stop(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()


class FakeProducer:
    """Answers check-backs of every group but the probe's, as the queued `CheckAnswer`s say."""

    def __init__(self, nc: Client, ledger: Ledger, never_prepared: set[str]) -> None:
        self.nc = nc
        self.ledger = ledger
        self.never_prepared = never_prepared
        self.unexpected: list[str] = []
        """Check-backs of transactions whose prepare was not to be executed."""
        self.answers: deque[CheckAnswer] = deque()
        self.checks = 0
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe("txn.check.>", cb=self._on_check)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def _on_check(self, msg: Msg) -> None:
        if msg.subject.split(".")[2] == PROBE_GROUP or not msg.reply:
            return
        self.checks += 1
        answer = self.answers.popleft() if self.answers else CheckAnswer("default", "none")
        try:
            check = _check.decode(msg.data)
        except (msgspec.DecodeError, UnicodeDecodeError):
            return
        txid, check_id = check.txid, check.check_id
        if txid in self.never_prepared:
            self.unexpected.append(f"a check-back for {txid}, prepared with a refused reply")
        payload: bytes
        headers = None
        if answer.kind == "none":
            return
        if answer.kind == "echo":
            fields = {"type": "CheckResult", "txid": txid, "check_id": check_id}
            fields["resolution"] = answer.resolution
            if answer.resolution == Decision.COMMIT.value:
                self.ledger.may_commit.add(txid)
            payload = encode_json(fields) if answer.json else msgspec.msgpack.encode(fields)
            headers = dict(JSON) if answer.json else None
        elif answer.kind == "mismatch":
            fields = {"type": "CheckResult", "txid": txid + "x", "check_id": check_id + 1}
            payload = msgspec.msgpack.encode({**fields, "resolution": answer.resolution})
        elif answer.kind == "error":
            payload = msgspec.msgpack.encode({"type": "Error", "code": "internal", "message": "x"})
        else:
            payload = answer.garbage
        await self.nc.publish(msg.reply, payload, headers=headers)


class BusRecorder:
    """Every message on the bus that mentions one of `markers` (in its body or a header),
    except requests to the coordinator, answers to inboxes and JetStream consumers'
    deliveries (reads: they carry the stream's subject): what a request that was not to be
    executed must never cause (a write to a stream is a publish too)."""

    def __init__(self, markers: list[str]) -> None:
        self.markers = [m.encode() for m in markers]
        self.seen: list[str] = []
        self._sub: Subscription | None = None

    async def start(self, nc: Client) -> None:
        async def seen(msg: Msg) -> None:
            if msg.subject.startswith(("_INBOX.", "txn.coord.")):
                return
            if (msg.reply or "").startswith("$JS.ACK."):
                return  # a consumer's delivery (the coordinator reading TXN_HALF), not a write
            text = msg.data + repr(msg.headers).encode()
            if any(marker in text for marker in self.markers):
                self.seen.append(f"{msg.subject}: {msg.data[:80]!r} {msg.headers!r}"[:300])

        self._sub = await nc.subscribe(">", cb=seen)
        await nc.flush()

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()


# -- one batch ------------------------------------------------------------------------------------


@dataclass
class Outcome:
    label: str
    problem: str | None


class Harness:
    """The bus as the tests see it; `run(batch)` sends a batch, `check()` runs the invariants."""

    def __init__(self, nc: Client, coordinator: CoordinatorProcess) -> None:
        self.nc = nc
        self.coordinator = coordinator
        self.partitions = coordinator.partitions
        self.url = coordinator.url
        self.ledger = Ledger()
        self.never_prepared: set[str] = set()
        """Txids of valid prepares sent with a refused reply subject: they must not exist."""
        self._unverified: list[str] = []
        self._flow_txids: set[str] = set()
        self.probe = Probe(nc, self.ledger, self.partitions)
        self.spies = Spies()
        self.fake = FakeProducer(nc, self.ledger, self.never_prepared)
        self.outcomes: list[Outcome] = []
        self.history: deque[list[str]] = deque(maxlen=3)
        self._topic_seen: dict[str, int] = {}
        """Per TOPIC_* stream: the last sequence already judged."""
        self._topic_count: dict[str, int] = {}
        self._found: dict[str, Msg] = {}
        """Committed messages by Nats-Msg-Id, for the intact-arrival check."""

    async def __aenter__(self) -> Harness:
        await self.spies.start(self.nc, self.partitions)
        await self.fake.start()
        await self.probe.producer.__aenter__()
        await self.probe.consumer.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.probe.consumer.__aexit__(None, None, None)
        await self.probe.producer.__aexit__(None, None, None)
        await self.fake.stop()
        await self.spies.stop()

    async def run(self, batch: list[FuzzInput]) -> None:
        self.history.append([item.label for item in batch])
        async with anyio.create_task_group() as tg:
            for item in batch:
                tg.start_soon(self._one, item)

    async def _one(self, item: FuzzInput) -> None:
        if isinstance(item, Request):
            self.outcomes.append(Outcome(item.label, await self._request(item)))
        elif isinstance(item, Flow):
            self.outcomes.append(Outcome(item.label, await self._flow(item)))
        elif isinstance(item, RawFrame):
            self.outcomes.append(Outcome(item.label, await self._raw(item)))
        else:
            self.fake.answers.append(item)

    async def _request(self, item: Request) -> str | None:
        if len(item.payload) > self.nc.max_payload:
            return None  # the client cannot send it; nothing to learn
        if item.reply is not None:
            if item.never_prepared:
                self.never_prepared.add(item.never_prepared)
                self._unverified.append(item.never_prepared)
            await self.nc.publish(
                item.subject, item.payload, reply=item.reply, headers=item.headers
            )
            return None
        try:
            msg = await self.nc.request(
                item.subject, item.payload, timeout=REPLY_TIMEOUT, headers=item.headers
            )
        except nats.errors.TimeoutError:
            return f"{item.label}: no answer in {REPLY_TIMEOUT}s on {item.subject}"
        except nats.errors.NoRespondersError:
            return f"{item.label}: nobody serves {item.subject}"
        reply = decode_reply(msg.data)
        if item.items is not None or item.whole:
            problem = judge_batch(item, reply)
        else:
            problem = judge(item.expect, reply)
        if isinstance(reply, Prepared) and item.command:
            self.ledger.store(reply.txid, _messages(item.command))
        if isinstance(reply, PreparedBatch) and item.command:
            for result, sent in zip(reply.results, item.command["items"], strict=False):
                if isinstance(result, Prepared):
                    self.ledger.store(result.txid, _messages(sent))
        return f"{item.label}: {problem}" if problem else None

    async def _raw(self, frame: RawFrame) -> str | None:
        """A raw HPUB; with an inbox reply, it is owed the answer `frame.expect` says."""
        if not frame.answered:
            await raw_hpub(
                self.url, frame.subject, "_INBOX.nobody", frame.header_block, frame.payload
            )
            return None
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox, max_msgs=1)
        try:
            await self.nc.flush()
            await raw_hpub(self.url, frame.subject, inbox, frame.header_block, frame.payload)
            msg = await sub.next_msg(timeout=REPLY_TIMEOUT)
        except nats.errors.TimeoutError:
            return f"{frame.label}: no answer in {REPLY_TIMEOUT}s on {frame.subject}"
        finally:
            await sub.unsubscribe()
        problem = judge(frame.expect, decode_reply(msg.data))
        return f"{frame.label}: {problem}" if problem else None

    def _fresh(self, flow: Flow) -> Flow:
        """`flow` under a txid no earlier flow used: a txid names one transaction, and
        Hypothesis draws the same few txids again and again."""
        txid = original = flow.prepare["txid"]
        n = 0
        while txid in self._flow_txids:
            n += 1
            txid = f"{original}-{n}"
        self._flow_txids.add(txid)
        if txid == original:
            return flow
        partition = layout.partition_of(txid, self.partitions)
        return replace(flow, partition=partition, prepare={**flow.prepare, "txid": txid})

    async def _flow(self, flow: Flow) -> str | None:
        flow = self._fresh(flow)
        prepare = Request(
            flow.label,
            layout.prepare_subject(flow.partition, flow.group),
            msgspec.msgpack.encode(flow.prepare),
            {Verdict.OK: Expect.ACCEPTED, Verdict.MAYBE: Expect.ANSWER}.get(
                flow.verdict, Expect.BAD_REQUEST
            ),
            command=flow.prepare,
        )
        if len(prepare.payload) > self.nc.max_payload:
            return None
        try:
            msg = await self.nc.request(prepare.subject, prepare.payload, timeout=REPLY_TIMEOUT)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as error:
            return f"{flow.label}: prepare got no answer ({error!r})"
        reply = decode_reply(msg.data)
        if problem := judge(prepare.expect, reply):
            return f"{flow.label}: prepare: {problem}"
        if not isinstance(reply, Prepared):
            return None
        txid = flow.prepare["txid"]
        messages = _messages(flow.prepare)
        self.ledger.store(txid, messages)
        if flow.decision is None:
            return None
        if flow.decision is Decision.COMMIT:
            self.ledger.may_commit.add(txid)
        end = {
            "type": "EndTransaction",
            "version": PROTOCOL_VERSION,
            "txid": txid,
            "token": reply.token,
        }
        if flow.oneway:  # nothing to wait for; the topics check judges what it publishes
            end = {**end, "decision": flow.decision.value}
            subject = layout.end_subject(flow.partition, flow.group)
            await self.nc.publish(subject, msgspec.msgpack.encode(end))
            return None
        try:
            msg = await self.nc.request(
                layout.end_subject(flow.partition, flow.group),
                msgspec.msgpack.encode({**end, "decision": flow.decision.value}),
                timeout=REPLY_TIMEOUT,
            )
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as error:
            return f"{flow.label}: accepted at prepare, then its end got no answer ({error!r})"
        ended = decode_reply(msg.data)
        want = {Decision.COMMIT: "committed", Decision.ROLLBACK: "rolled_back"}.get(flow.decision)
        if not isinstance(ended, Ended) or (want and ended.state != want):
            return f"{flow.label}: accepted at prepare, then its end was answered {ended!r}"
        if want == "committed":
            self.ledger.must_arrive[txid] = messages
        return None

    # -- invariants ------------------------------------------------------------------------------

    async def check(self) -> list[str]:
        """Every invariant; the problems found (empty when the coordinator survived)."""
        problems = coordinator_is_alive(self.coordinator)
        problems += every_request_was_answered(self.outcomes)
        if self.coordinator.alive():
            problems += await every_partition_commits(self.probe)
        problems += no_reply_left_the_inbox(self.spies)  # after the probe: leaks have landed
        problems += await refused_replies_were_not_executed(self)
        problems += await topics_hold_only_committed_messages(self)
        problems += accepted_transactions_arrive_intact(self)
        problems += await leases_are_the_coordinators(self)
        self.outcomes.clear()
        self.spies.leaks.clear()
        return problems

    async def restart(self, *, kill: bool) -> list[str]:
        """SIGKILL or SIGTERM the coordinator, start it again: every partition must recover."""
        return await restart_recovers_every_partition(self, kill=kill)

    def report(self, problems: list[str]) -> str:
        batches = "\n".join(
            f"  batch -{i}: {labels}" for i, labels in enumerate(reversed(self.history))
        )
        return (
            "\n".join(problems)
            + f"\nrecent batches (newest first):\n{batches}"
            + f"\ncoordinator log tail:\n{self.coordinator.log_tail(15)}"
        )


def _messages(command: dict[str, Any]) -> list[dict[str, Any]]:
    messages = command.get("messages")
    return [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []


def judge(expect: Expect, reply: Reply | None) -> str | None:
    """What is wrong with `reply` to a request that was owed `expect` (None: nothing)."""
    if reply is None:
        return "the answer is not a protocol reply"
    if isinstance(reply, Error):
        if reply.code not in set(ErrorCode):
            return f"unknown error code {reply.code!r}"
        if reply.code == ErrorCode.INTERNAL:
            return f"answered internal: {reply.message[:200]}"
    if expect is Expect.ACCEPTED and not isinstance(reply, Prepared):
        return f"expected {expect.value}, got {_shown(reply)}"
    if expect is Expect.VALID and isinstance(reply, Error) and reply.code == "bad_request":
        return f"expected {expect.value}, got {_shown(reply)}"
    wanted = {
        Expect.BAD_REQUEST: {ErrorCode.BAD_REQUEST},
        Expect.UNSUPPORTED: {ErrorCode.UNSUPPORTED_VERSION},
        Expect.REJECTED: {ErrorCode.BAD_REQUEST, ErrorCode.UNKNOWN_COMMAND},
        Expect.REFUSED: set(ErrorCode) - {ErrorCode.INTERNAL, ErrorCode.BAD_REQUEST},
    }.get(expect)
    if wanted is not None and not (isinstance(reply, Error) and reply.code in wanted):
        return f"expected {expect.value}, got {_shown(reply)}"
    return None


def judge_batch(item: Request, reply: Reply | None) -> str | None:
    """What is wrong with the answer to a batch: an `Error` it may be refused with whole, or
    one result per item, each what that item's lone command is owed."""
    if isinstance(reply, Error) and reply.code in item.whole:
        return None
    if item.items is None or not isinstance(reply, PreparedBatch | EndedBatch):
        owed = "/".join(sorted(item.whole)) or "a batch answer"
        return f"expected {owed}, got {_shown(reply) if reply else reply!r}"
    if len(reply.results) != len(item.items):
        return f"{len(reply.results)} results for {len(item.items)} items"
    problems = [
        f"item {i}: {problem}"
        for i, (expect, result) in enumerate(zip(item.items, reply.results, strict=True))
        if (problem := judge(expect, result)) is not None
    ]
    return "; ".join(problems) or None


def _shown(reply: Reply) -> str:
    if isinstance(reply, Error):
        return f"{reply.code}: {reply.message[:160]}"
    return repr(reply)[:160]


# -- the invariants -------------------------------------------------------------------------


def coordinator_is_alive(coordinator: CoordinatorProcess) -> list[str]:
    if coordinator.alive():
        return []
    return [f"the coordinator process exited (code {coordinator.returncode()})"]


def every_request_was_answered(outcomes: list[Outcome]) -> list[str]:
    return [o.problem for o in outcomes if o.problem]


def no_reply_left_the_inbox(spies: Spies) -> list[str]:
    return list(spies.leaks)


async def refused_replies_were_not_executed(harness: Harness) -> list[str]:
    """A valid prepare whose reply subject was refused left no transaction and no check-back."""
    problems = list(harness.fake.unexpected)
    harness.fake.unexpected.clear()
    if not harness.coordinator.alive():
        return problems
    unverified, harness._unverified = harness._unverified, []
    for txid in unverified:
        subject = layout.admin_subject(layout.partition_of(txid, harness.partitions))
        show = msgspec.msgpack.encode(
            {"type": "ShowTransaction", "version": PROTOCOL_VERSION, "txid": txid}
        )
        try:
            msg = await harness.nc.request(subject, show, timeout=REPLY_TIMEOUT)
        except nats.errors.Error as error:
            problems.append(f"ShowTransaction {txid} got no answer ({error!r})")
            continue
        reply = decode_reply(msg.data)
        if not (isinstance(reply, Error) and reply.code == ErrorCode.NOT_FOUND):
            problems.append(f"{txid}, prepared with a refused reply subject, exists: {reply!r}")
    return problems


async def every_partition_commits(probe: Probe) -> list[str]:
    results = [await probe.transaction_on(p) for p in range(probe.partitions)]
    return [r for r in results if r]


async def topics_hold_only_committed_messages(harness: Harness) -> list[str]:
    """Every message in every TOPIC_* stream belongs to a transaction someone entitled to
    commit it committed, with the content that was prepared; none was removed."""
    js = harness.nc.jetstream()
    problems: list[str] = []
    for info in await js.streams_info():
        stream = info.config.name or ""
        if not stream.startswith("TOPIC_"):
            continue
        start = harness._topic_seen.get(stream, 0) + 1
        topic = stream.removeprefix("TOPIC_")
        last = info.state.last_seq  # later commits (check-backs) are judged next time
        if last >= start:
            async for msg in read_subject(js, stream, layout.topic_filter(topic), start):
                if msg.metadata.sequence.stream > last:
                    continue
                harness._topic_seen[stream] = msg.metadata.sequence.stream
                harness._topic_count[stream] = harness._topic_count.get(stream, 0) + 1
                txid = header(msg, layout.TXID_HEADER)
                if not harness.ledger.allows(txid, topic, msg.data):
                    problems.append(
                        f"{stream} seq {msg.metadata.sequence.stream} on {msg.subject} is no "
                        f"committed transaction's (txid {txid!r}): {msg.data[:60]!r}"
                    )
                msg_id = header(msg, layout.MSG_ID_HEADER)
                if msg_id:
                    harness._found[msg_id] = msg
        kept = info.state.messages
        if kept != harness._topic_count.get(stream, 0):
            problems.append(
                f"{stream} holds {kept} messages, {harness._topic_count.get(stream, 0)} were "
                "committed to it: something removed or rewrote committed messages"
            )
    return problems


def accepted_transactions_arrive_intact(harness: Harness) -> list[str]:
    """A transaction accepted at prepare and committed is delivered as prepared: body, keys
    and properties (non-ASCII included), under the coordinator's own message id."""
    problems: list[str] = []
    for txid, messages in harness.ledger.must_arrive.items():
        for index, sent in enumerate(messages):
            msg = harness._found.get(layout.message_id(txid, index))
            if msg is None:
                problems.append(f"committed {txid}:{index} never reached TOPIC_{sent['topic']}")
                continue
            got = {k: str(v) for k, v in (msg.headers or {}).items()}
            want = {str(k): str(v) for k, v in sent.get("properties", {}).items()}
            if msg.data != sent["body"] or any(got.get(k) != v for k, v in want.items()):
                problems.append(
                    f"committed {txid}:{index} arrived altered: properties {want!r} "
                    f"became {{{', '.join(f'{k}: {got.get(k)!r}' for k in want)}}}"
                )
            keys = ",".join(sent.get("keys", []))
            if keys and got.get(layout.KEYS_HEADER) != keys:
                problems.append(
                    f"committed {txid}:{index}: keys {keys!r} arrived as "
                    f"{got.get(layout.KEYS_HEADER)!r}"
                )
    harness.ledger.must_arrive.clear()
    return problems


async def leases_are_the_coordinators(harness: Harness) -> list[str]:
    """Each partition's lease is held, by one coordinator id, and is not a reply someone
    had the coordinator publish into the KV bucket."""
    if not harness.coordinator.alive():
        return []
    kv = await harness.nc.jetstream().key_value(layout.LEASE_BUCKET)
    owners: dict[int, bytes | None] = {}
    for p in range(harness.partitions):
        try:
            owners[p] = (await kv.get(str(p))).value
        except Exception as error:
            owners[p] = None
            return [f"partition {p}: its lease is gone ({error!r})"]
    problems = [
        f"partition {p}: the lease holds a protocol reply, not an owner id: {v!r}"
        for p, v in owners.items()
        if v is not None and decode_reply(v) is not None
    ]
    if len(set(owners.values())) != 1:
        problems.append(f"partition leases disagree on their owner: {owners!r}")
    return problems


async def restart_recovers_every_partition(harness: Harness, *, kill: bool) -> list[str]:
    """Stop (SIGKILL, or SIGTERM that must be honoured in time), start again, probe all."""
    problems: list[str] = []
    if kill:
        await harness.coordinator.kill()
    elif not await harness.coordinator.terminate():
        problems.append("the coordinator ignored SIGTERM (SIGKILLed after 5 s)")
    try:
        await harness.coordinator.start()
    except AssertionError as error:
        return [*problems, f"the coordinator could not start again: {error}"]
    deadline = anyio.current_time() + RECOVERY_DEADLINE
    for partition in range(harness.partitions):
        while (problem := await harness.probe.transaction_on(partition)) is not None:
            if anyio.current_time() > deadline or not harness.coordinator.alive():
                problems.append(f"after restart, not recovered in {RECOVERY_DEADLINE}s: {problem}")
                break
            await anyio.sleep(0.2)  # not a wait to fail: a problem is reported, not raised
    return problems
