"""Fuzzing a real coordinator process: no input from the bus may break the service.

A coordinator runs as its own process (`python -m txactors.cli coordinator`, 3 partitions) on
a private nats-server. Hypothesis draws batches of inputs (tests/support/fuzz_inputs.py):
every command and field of the protocol with odd values, raw bytes in both encodings,
properties that spell control headers, replies aimed at topics, KV keys, `txn.*` and `$JS.*`
subjects, sizes at the server's limits, malformed header blocks on a raw socket, and garbage
answers to check-backs. After every batch the invariants of tests/support/fuzz_harness.py
must hold: the process is alive, every request was answered as the protocol says, no reply
left the inbox, a normal transaction commits and is consumed on every partition, the topics
hold only committed messages, and leases are intact; every few batches the coordinator is
SIGKILLed or SIGTERMed and must recover every partition.

The Hypothesis runs carry state from one example to the next (the same coordinator and
streams), so they generate without shrinking; a failure reports the recent batches and the
coordinator's log. The targeted tests below pin each class of attack the issue names.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import anyio
import anyio.from_thread
import anyio.to_thread
import msgspec
import pytest
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import strategies as st

from tests.support.coordinator_process import CoordinatorProcess
from tests.support.fuzz_harness import (
    PROBE_TOPIC,
    REPLY_TIMEOUT,
    BusRecorder,
    Harness,
    Reply,
    decode_reply,
    every_partition_commits,
    topics_hold_only_committed_messages,
)
from tests.support.fuzz_inputs import (
    JSON,
    MAX_IMMUNITY,
    MAX_KEY,
    MAX_PROPERTY_NAME,
    NAME_LIMITS,
    PROTOCOL_VERSION,
    CheckAnswer,
    Expect,
    Flow,
    FuzzInput,
    RawFrame,
    Request,
    Verdict,
    batch_requests,
    batches,
    encode_json,
    end_on,
    hostile_replies,
    invalid_utf8,
    long_name,
    nested,
    prepare_on,
)
from tests.support.servers import MakeNatsServer
from tests.support.wait import eventually
from txactors.nats.client import connect
from txactors.producer import Decision
from txactors.wire import layout
from txactors.wire.protocol import Prepared, TransactionInfo

PARTITIONS = 3

CI = settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    report_multiple_bugs=False,
    suppress_health_check=list(HealthCheck),
    verbosity=Verbosity.quiet,
)
"""Deterministic and bounded: the same 50 batches on every run, no shrinking (state carries
over between examples, so a shrunk example would not reproduce). Quiet: a failure names the
batches by label (`Harness.report`) instead of printing near-max_payload bodies."""
LONG = settings(CI, max_examples=200)
"""Deterministic too: CI runs `slow` tests, and must fail on a regression, not on a new draw."""
RESTART_EVERY = 4


OpenBus = Callable[[], AbstractAsyncContextManager[Harness]]


@pytest.fixture
def open_bus(make_nats_server: MakeNatsServer, tmp_path: Path) -> OpenBus:
    """`async with open_bus() as bus`: a fresh server, a coordinator process on it, and the
    harness, healthy to begin with. (A context manager, not a fixture value: the harness's
    task groups must be entered and left in the test's own task.)"""

    @asynccontextmanager
    async def opened() -> AsyncIterator[Harness]:
        server = await make_nats_server()
        coordinator = CoordinatorProcess(server.url, tmp_path, partitions=PARTITIONS)
        await coordinator.start()

        async def quiet(error: Exception) -> None:
            pass

        nc = await connect(server.url, name="fuzzer", error_cb=quiet)
        try:
            async with Harness(nc, coordinator) as harness:
                assert await every_partition_commits(harness.probe) == [], coordinator.log_tail()
                yield harness
        finally:
            await nc.close()
            await coordinator.kill()

    return opened


async def assert_survives(harness: Harness, batch: list[FuzzInput], *, restart: str = "") -> None:
    """Send `batch`, then every invariant; with `restart` ("kill"/"term"), recovery too."""
    await harness.run(batch)
    problems = await harness.check()
    if restart:
        problems += await harness.restart(kill=restart == "kill")
    assert not problems, harness.report(problems)


# -- Hypothesis: every kind of input, mixed ------------------------------------------------------


async def fuzz(
    harness: Harness,
    config: settings,
    inputs: st.SearchStrategy[list[FuzzInput]] | None = None,
) -> None:
    """Run Hypothesis in a worker thread; each example's I/O runs on the test's event loop.
    `inputs`: what to draw (by default every kind of input, mixed)."""
    counter = itertools.count(1)

    if inputs is None:
        inputs = batches(PARTITIONS, harness.nc.max_payload, PROBE_TOPIC)

    @config
    @given(batch=inputs)
    def one_batch(batch: list[FuzzInput]) -> None:
        n = next(counter)
        restart = "" if n % RESTART_EVERY else ("kill" if n // RESTART_EVERY % 2 else "term")
        anyio.from_thread.run(lambda: assert_survives(harness, batch, restart=restart))

    await anyio.to_thread.run_sync(one_batch)


LARGE_REPR = "ignore:Generating overly large repr"
"""Batches hold near-max_payload bodies; Hypothesis warns when it prints them on a failure."""


@pytest.mark.filterwarnings(LARGE_REPR)
async def test_fuzzed_batches_leave_every_partition_serving(open_bus: OpenBus) -> None:
    async with open_bus() as bus:
        await fuzz(bus, CI)


@pytest.mark.filterwarnings(LARGE_REPR)
async def test_fuzzed_batch_commands_answer_every_item(open_bus: OpenBus) -> None:
    """`PrepareBatch` and `EndBatch` with odd items, versions, groups and sizes, one-way too:
    each gets one answer with a result per item, each what its lone command is owed, or is
    refused whole as docs/protocol.md#batches says; every invariant holds after each."""
    async with open_bus() as bus:
        requests = batch_requests(PARTITIONS, bus.nc.max_payload)
        await fuzz(bus, settings(CI, max_examples=20), st.lists(requests, min_size=1, max_size=6))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.filterwarnings(LARGE_REPR)
async def test_fuzzed_batches_long_run(open_bus: OpenBus) -> None:
    async with open_bus() as bus:
        await fuzz(bus, LONG)


# -- targeted: each class of attack the issue names ------------------------------------------------


def prepare(txid: str, **fields: object) -> dict[str, object]:
    """A first Prepare of one message; `group` and `producer` among `fields` go to the
    command, the rest to the message."""
    command: dict[str, object] = {"type": "Prepare", "version": PROTOCOL_VERSION, "txid": txid}
    command["group"] = fields.pop("group", "fzgroup")
    command["producer"] = fields.pop("producer", "fzprod")
    command["messages"] = [{"topic": "fz", "body": b"x", **fields}]
    return command


def request(
    label: str, subject: str, command: dict[str, object], expect: Expect, **kw: object
) -> Request:
    return Request(label, subject, msgspec.msgpack.encode(command), expect, command=command, **kw)  # type: ignore[arg-type]


async def ask(bus: Harness, subject: str, command: dict[str, object]) -> Reply | None:
    msg = await bus.nc.request(subject, msgspec.msgpack.encode(command), timeout=REPLY_TIMEOUT)
    return decode_reply(msg.data)


async def state_of(bus: Harness, txid: str) -> str:
    subject = layout.admin_subject(layout.partition_of(txid, PARTITIONS))
    info = await ask(
        bus, subject, {"type": "ShowTransaction", "version": PROTOCOL_VERSION, "txid": txid}
    )
    return info.state if isinstance(info, TransactionInfo) else repr(info)


async def test_replies_never_leave_the_inbox(open_bus: OpenBus) -> None:
    """Requests of every verb with a reply subject that is not an inbox (a topic, a lease,
    the op and half streams, the JetStream API, the checkpoint) are neither answered nor
    executed: no transaction is prepared, an open one is not ended (even with its right
    token), and nothing about either is written or published anywhere."""
    async with open_bus() as bus:
        opened: list[str] = []
        for n, reply in enumerate(hostile_replies(1, PROBE_TOPIC)):
            opened.append(await _refused_reply_leaves_no_trace(bus, reply, n))
        await assert_survives(bus, [], restart="term")
        assert [await state_of(bus, txid) for txid in opened] == ["prepared"] * len(opened)


async def _refused_reply_leaves_no_trace(bus: Harness, reply: str, n: int) -> str:
    """One hostile `reply` on every verb; the txid left open (it must stay prepared)."""
    opened, fresh = f"hostileopen{n}", f"hostilefresh{n}"
    immune = prepare(opened, check_immunity=600.0)  # no check-back during the test
    own = layout.partition_of(opened, PARTITIONS)
    prepared = await ask(bus, prepare_on(own), immune)
    assert isinstance(prepared, Prepared), prepared
    bus.ledger.store(opened, immune["messages"])  # type: ignore[arg-type]
    recorder = BusRecorder([opened, fresh])
    await recorder.start(bus.nc)

    def hostile(label: str, subject: str, command: dict[str, object]) -> Request:
        return request(f"{reply}: {label}", subject, command, Expect.NO_ANSWER, reply=reply)

    end: dict[str, object] = {
        "type": "EndTransaction",
        "version": PROTOCOL_VERSION,
        "txid": opened,
        "token": prepared.token,
        "decision": "commit",
    }
    batch: list[FuzzInput] = [
        Request(
            f"{reply}: valid prepare",
            prepare_on(layout.partition_of(fresh, PARTITIONS)),
            msgspec.msgpack.encode(prepare(fresh)),
            Expect.NO_ANSWER,
            reply=reply,
            never_prepared=fresh,
        ),
        hostile("bad prepare", prepare_on(own), {"type": "Prepare", "version": PROTOCOL_VERSION}),
        hostile("end with the right token", end_on(own), end),
        hostile(
            "admin commit",
            layout.admin_subject(own),
            {"type": "CommitTransaction", "version": PROTOCOL_VERSION, "txid": opened},
        ),
        hostile(
            "admin rollback",
            layout.admin_subject(own),
            {"type": "RollbackTransaction", "version": PROTOCOL_VERSION, "txid": opened},
        ),
        hostile(
            "admin list",
            layout.admin_subject(own),
            {"type": "ListTransactions", "version": PROTOCOL_VERSION},
        ),
        Request("garbage", layout.admin_subject(own), b"\xc1", Expect.NO_ANSWER, reply=reply),
    ]
    try:
        await assert_survives(bus, batch)  # the probe on every partition: time to act
        assert await state_of(bus, opened) == "prepared"
    finally:
        await recorder.stop()
    assert recorder.seen == [], "\n".join(recorder.seen)
    return opened


async def test_malformed_header_blocks_are_contained(open_bus: OpenBus) -> None:
    """A raw HPUB whose header block nats-py's parser may choke on, on every command subject,
    with an inbox reply (answered `bad_request`) and without one: the coordinator keeps
    serving, and still stops on SIGTERM."""
    async with open_bus() as bus:
        batch: list[FuzzInput] = [
            RawFrame(f"raw {block!r}", subject(p), block, b"", answered, Expect.BAD_REQUEST)
            for block in (
                b"NATS",
                b"NATS/1.0",
                b"NATS/1.0\r\nX\r\n\r\n",
                b"NATS/1.0\r\n\xff: \xff\r\n\r\n",
            )
            for p in range(PARTITIONS)
            for subject in (prepare_on, end_on, layout.admin_subject)
            for answered in (True, False)
        ]
        await assert_survives(bus, batch, restart="term")


async def test_properties_spelling_control_headers_are_refused(open_bus: OpenBus) -> None:
    """`Nats-…`/`Txn-…` in any case or with blanks, `Status`, colons, spaces, non-ASCII:
    bad_request, nothing stored."""
    async with open_bus() as bus:
        names = [
            "Nats-Msg-Id",
            " nats-expected-stream",
            "NATS-EXPECTED-LAST-SUBJECT-SEQUENCE",
            "nats-msg-id",
            "\tNats-Msg-Id",
            "Nats-Msg-Id ",
            "txn-id",
            "TXN-TOKEN",
            "status",
            "KV-Operation",
            "a b",
            "a:b",
            "café",
        ]
        batch: list[FuzzInput] = [
            request(
                f"property {name!r}",
                prepare_on(layout.partition_of(f"h{i}", PARTITIONS)),
                prepare(f"h{i}", properties={name: "forged"}),
                Expect.BAD_REQUEST,
            )
            for i, name in enumerate(names)
        ]
        await assert_survives(bus, batch, restart="kill")


NON_ASCII: dict[str, dict[str, object]] = {
    "value": {"properties": {"note": "café 日本語 🙂"}},
    "key": {"keys": ["café", "键 a"]},
}


async def test_non_ascii_values_and_keys_work_end_to_end(open_bus: OpenBus) -> None:
    """`café` in a property value or a key: accepted, and delivered intact when committed
    directly and when a check-back commits it, before and after a restart."""
    async with open_bus() as bus:
        batch: list[FuzzInput] = []
        checked: list[str] = []
        for kind, message in NON_ASCII.items():
            direct, check = f"na-direct-{kind}", f"na-check-{kind}"
            checked.append(check)
            batch += [
                Flow(
                    "commit",
                    layout.partition_of(direct, PARTITIONS),
                    prepare(direct, **message),
                    Verdict.OK,
                    Decision.COMMIT,
                ),
                CheckAnswer("check commits", "echo", resolution="commit"),
                Flow(
                    "check-back",
                    layout.partition_of(check, PARTITIONS),
                    prepare(check, **message),
                    Verdict.OK,
                    None,
                ),
            ]
        await assert_survives(bus, batch)

        async def checked_arrived() -> bool:  # the check-backs are due after 0.3 s
            assert await topics_hold_only_committed_messages(bus) == []
            return all(layout.message_id(txid, 0) in bus._found for txid in checked)

        await eventually(checked_arrived, interval=0.1, what="the checked messages on the topic")
        for txid in checked:
            bus.ledger.must_arrive[txid] = bus.ledger.stored[txid]
        await assert_survives(bus, [], restart="term")


async def test_the_same_txid_on_two_partitions(open_bus: OpenBus) -> None:
    """Prepared on its own partition, then with other content on another one: bad_request
    there (naming the owner), and only the first content is ever delivered."""
    async with open_bus() as bus:
        txid = "twice"
        own = layout.partition_of(txid, PARTITIONS)
        other = (own + 1) % PARTITIONS
        batch: list[FuzzInput] = [
            Flow(
                "own partition, commit", own, prepare(txid, body=b"A"), Verdict.OK, Decision.COMMIT
            ),
        ]
        await assert_survives(bus, batch)
        await assert_survives(
            bus,
            [
                request(
                    "other partition",
                    prepare_on(other),
                    prepare(txid, body=b"B"),
                    Expect.BAD_REQUEST,
                ),
                request(
                    "other partition, end",
                    end_on(other),
                    {
                        "type": "EndTransaction",
                        "version": PROTOCOL_VERSION,
                        "txid": txid,
                        "token": "0" * 32,
                        "decision": "commit",
                    },
                    Expect.BAD_REQUEST,
                ),
                request(
                    "own partition, a second first prepare",
                    prepare_on(own),
                    prepare(txid, body=b"C"),
                    Expect.REFUSED,
                ),
                CheckAnswer("check commits", "echo", resolution="commit"),
            ],
            restart="kill",
        )


async def test_undecodable_input_is_a_bad_request(open_bus: OpenBus) -> None:
    """Invalid UTF-8, deep nesting and numbers out of range, in both encodings: bad_request,
    never internal."""
    async with open_bus() as bus:
        await assert_survives(bus, [*_undecodable(as_json=False), *_undecodable(as_json=True)])


def _undecodable(*, as_json: bool) -> list[FuzzInput]:
    """Payloads no decoder may crash on, and immunities outside [0, max_immunity]."""
    headers = dict(JSON) if as_json else None
    subject = prepare_on(0)

    def encoded(command: dict[str, object]) -> bytes:
        return encode_json(command) if as_json else msgspec.msgpack.encode(command)

    def immunity(txid: str, value: float) -> Request:
        txid += "j" if as_json else "m"
        return Request(
            f"immunity {value} ({'json' if as_json else 'mp'})",
            prepare_on(layout.partition_of(txid, PARTITIONS)),
            encoded(prepare(txid, check_immunity=value)),
            Expect.BAD_REQUEST,
            headers,
        )

    batch: list[FuzzInput] = [
        Request("invalid UTF-8", subject, invalid_utf8(as_json), Expect.BAD_REQUEST, headers),
        *(
            Request(f"nested {d}", subject, nested(d, as_json=as_json), Expect.BAD_REQUEST, headers)
            for d in (1000, 100_000)
        ),
        immunity("nf", float("nan")),
        immunity("nf2", float("inf")),
        immunity("nf3", -1.0),
        immunity("nf4", MAX_IMMUNITY + 1),
    ]
    return batch


def _sized_cases(max_payload: int) -> dict[str, tuple[dict[str, object], Verdict]]:
    """Each limit of docs/protocol.md#limits at its value (accepted) and past it (refused)."""
    at = {kind: long_name(limit) for kind, limit in NAME_LIMITS.items()}
    past = {kind: long_name(limit + 1) for kind, limit in NAME_LIMITS.items()}
    return {
        "body well within max_payload": ({"body": b"b" * (max_payload - 4096)}, Verdict.OK),
        "body near max_payload": ({"body": b"b" * (max_payload - 600)}, Verdict.BAD),
        "headers near 64 KiB": ({"properties": {"p": "v" * 60_000}}, Verdict.OK),
        "headers over 64 KiB": (
            {"properties": {"p": "v" * 40_000, "q": "w" * 40_000}},
            Verdict.BAD,
        ),
        "key at its limit": ({"keys": ["k" * MAX_KEY]}, Verdict.OK),
        "key past its limit": ({"keys": ["k" * (MAX_KEY + 1)]}, Verdict.BAD),
        "key over 64 KiB": ({"keys": ["k" * 70_000]}, Verdict.BAD),
        "property name at its limit": (
            {"properties": {"p" * MAX_PROPERTY_NAME: "v"}},
            Verdict.OK,
        ),
        "property name past its limit": (
            {"properties": {"p" * (MAX_PROPERTY_NAME + 1): "v"}},
            Verdict.BAD,
        ),
        "names at their limits": (
            {
                "txid": at["txid"],
                "group": at["group"],
                "producer": at["producer"],
                "topic": at["topic"],
                "tag": at["tag"],
            },
            Verdict.OK,
        ),
        **{f"{kind} past its limit": ({kind: past[kind]}, Verdict.BAD) for kind in NAME_LIMITS},
        "txid of 4000": ({"txid": "L" * 4000}, Verdict.BAD),
    }


async def test_sizes_at_the_limits(open_bus: OpenBus) -> None:
    """At a documented limit: accepted, committed and delivered intact. Past it: bad_request,
    nothing stored. Either way every partition goes on serving and recovers."""
    async with open_bus() as bus:
        batch: list[FuzzInput] = []
        for n, (case, (fields, verdict)) in enumerate(_sized_cases(bus.nc.max_payload).items()):
            txid = str(fields.pop("txid", f"size{n}"))
            flow = Flow(
                case,
                layout.partition_of(txid, PARTITIONS),
                prepare(txid, **fields),
                verdict,
                Decision.COMMIT,
            )
            batch.append(flow)
        await assert_survives(bus, batch, restart="kill")
