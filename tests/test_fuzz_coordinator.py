"""Fuzzing a real coordinator process: no input from the bus may break the service (issue 9).

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
import nats
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from tests.conftest import MakeNatsServer
from tests.support.coordinator_process import CoordinatorProcess
from tests.support.fuzz_harness import (
    PROBE_TOPIC,
    Harness,
    every_partition_commits,
)
from tests.support.fuzz_inputs import (
    JSON,
    CheckAnswer,
    Expect,
    Flow,
    FuzzInput,
    RawFrame,
    Request,
    Verdict,
    batches,
    hostile_replies,
    invalid_utf8,
    nested,
)
from txactors import layout
from txactors.producer import Decision

PARTITIONS = 3

CI = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    report_multiple_bugs=False,
    suppress_health_check=list(HealthCheck),
)
"""Deterministic and bounded: the same 12 batches on every run, no shrinking (state carries
over between examples, so a shrunk example would not reproduce)."""
LONG = settings(CI, max_examples=150, derandomize=False)
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

        nc = await nats.connect(server.url, name="fuzzer", error_cb=quiet)
        try:
            async with Harness(nc, coordinator, server.host, server.port) as harness:
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


async def fuzz(harness: Harness, config: settings) -> None:
    """Run Hypothesis in a worker thread; each example's I/O runs on the test's event loop."""
    counter = itertools.count(1)

    @config
    @given(batch=batches(PARTITIONS, harness.nc.max_payload, PROBE_TOPIC))
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


@pytest.mark.slow
@pytest.mark.filterwarnings(LARGE_REPR)
async def test_fuzzed_batches_long_run(open_bus: OpenBus) -> None:
    async with open_bus() as bus:
        await fuzz(bus, LONG)


# -- targeted: each class of attack the issue names ------------------------------------------------


def prepare(txid: str, **message: object) -> dict[str, object]:
    body = {"topic": "fz", "body": b"x", **message}
    return {
        "type": "Prepare",
        "txid": txid,
        "group": "fzgroup",
        "producer": "fzprod",
        "messages": [body],
    }


def request(
    label: str, subject: str, command: dict[str, object], expect: Expect, **kw: object
) -> Request:
    return Request(label, subject, msgspec.msgpack.encode(command), expect, command=command, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "reply", hostile_replies(1, PROBE_TOPIC), ids=lambda r: r.replace("$", "").replace(".", "_")
)
async def test_replies_never_leave_the_inbox(open_bus: OpenBus, reply: str) -> None:
    """Requests of every verb answered (they must not be) to a subject that is not an inbox."""
    async with open_bus() as bus:
        p0 = 0
        batch: list[FuzzInput] = [
            request(
                "valid prepare",
                layout.prepare_subject(p0),
                prepare("r0"),
                Expect.NO_ANSWER,
                reply=reply,
            ),
            request(
                "bad prepare",
                layout.prepare_subject(p0),
                {"type": "Prepare"},
                Expect.NO_ANSWER,
                reply=reply,
            ),
            request(
                "end",
                layout.end_subject(p0),
                {"type": "EndTransaction", "txid": "r0", "token": "0" * 32, "decision": "commit"},
                Expect.NO_ANSWER,
                reply=reply,
            ),
            request(
                "admin",
                layout.admin_subject(p0),
                {"type": "ListTransactions"},
                Expect.NO_ANSWER,
                reply=reply,
            ),
            Request("garbage", layout.admin_subject(p0), b"\xc1", Expect.NO_ANSWER, reply=reply),
        ]
        await assert_survives(bus, batch, restart="term")


@pytest.mark.parametrize(
    "block",
    [b"NATS", b"NATS/1.0\r\nX\r\n\r\n", b"NATS/1.0\r\n\xff\xfe: \xff\r\n\r\n"],
    ids=["four-bytes", "no-colon", "not-utf8"],
)
async def test_malformed_header_block_is_contained(open_bus: OpenBus, block: bytes) -> None:
    """A raw HPUB whose header block nats-py's parser chokes on, on every command subject:
    the coordinator keeps serving, and still stops on SIGTERM."""
    async with open_bus() as bus:
        batch: list[FuzzInput] = [
            RawFrame("raw", subject(p), block, b"")
            for p in range(PARTITIONS)
            for subject in (layout.prepare_subject, layout.end_subject, layout.admin_subject)
        ]
        await assert_survives(bus, batch, restart="term")


async def test_properties_spelling_control_headers_are_refused(open_bus: OpenBus) -> None:
    """`Nats-…`/`Txn-…` in any case or with blanks, colons, spaces: bad_request, nothing stored."""
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
            "a b",
            "a:b",
        ]
        batch: list[FuzzInput] = [
            request(
                f"property {name!r}",
                layout.prepare_subject(layout.partition_of(f"h{i}", PARTITIONS)),
                prepare(f"h{i}", properties={name: "forged"}),
                Expect.BAD_REQUEST,
            )
            for i, name in enumerate(names)
        ]
        await assert_survives(bus, batch, restart="kill")


@pytest.mark.parametrize(
    "message",
    [{"properties": {"note": "café"}}, {"properties": {"café": "x"}}, {"keys": ["café"]}],
    ids=["property-value", "property-name", "key"],
)
async def test_non_ascii_properties_and_keys_work_end_to_end_or_are_refused(
    open_bus: OpenBus, message: dict[str, object]
) -> None:
    """`café`, committed directly, then left to a check-back that answers COMMIT: refused at
    prepare, or delivered intact both ways; never accepted and then fatal later."""
    async with open_bus() as bus:
        direct, checked = (layout.partition_of(t, PARTITIONS) for t in ("na-direct", "na-check"))
        await assert_survives(
            bus,
            [
                Flow(
                    "commit",
                    direct,
                    prepare("na-direct", **message),
                    Verdict.MAYBE,
                    Decision.COMMIT,
                )
            ],
        )
        checks = bus.fake.checks
        await assert_survives(
            bus,
            [
                CheckAnswer("check commits", "echo", resolution="commit"),
                Flow("check-back", checked, prepare("na-check", **message), Verdict.MAYBE, None),
            ],
        )
        with anyio.move_on_after(5):  # the check-back is due after 0.3 s
            while bus.fake.checks == checks:
                await anyio.sleep(0.05)
        await assert_survives(bus, [], restart="term")


async def test_the_same_txid_on_two_partitions(open_bus: OpenBus) -> None:
    """Prepared on its own partition, then with other content on another one: refused there,
    and only the first content is ever delivered."""
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
                    layout.prepare_subject(other),
                    prepare(txid, body=b"B"),
                    Expect.REFUSED,
                ),
                request(
                    "other partition, end",
                    layout.end_subject(other),
                    {
                        "type": "EndTransaction",
                        "txid": txid,
                        "token": "0" * 32,
                        "decision": "commit",
                    },
                    Expect.REFUSED,
                ),
                CheckAnswer("check commits", "echo", resolution="commit"),
            ],
            restart="kill",
        )


@pytest.mark.parametrize("as_json", [False, True], ids=["msgpack", "json"])
async def test_undecodable_input_is_a_bad_request(open_bus: OpenBus, as_json: bool) -> None:
    """Invalid UTF-8, deep nesting and non-finite numbers: bad_request, never internal."""
    async with open_bus() as bus:
        headers = dict(JSON) if as_json else None
        subject = layout.prepare_subject(0)
        nan_immunity = prepare("nf", check_immunity=float("nan"))
        inf_immunity = prepare("nf2", check_immunity=float("inf"))
        from tests.support.fuzz_inputs import encode_json

        def encoded(command: dict[str, object]) -> bytes:
            return encode_json(command) if as_json else msgspec.msgpack.encode(command)

        batch: list[FuzzInput] = [
            Request("invalid UTF-8", subject, invalid_utf8(as_json), Expect.BAD_REQUEST, headers),
            *(
                Request(
                    f"nested {d}", subject, nested(d, as_json=as_json), Expect.BAD_REQUEST, headers
                )
                for d in (1000, 100_000)
            ),
            Request(
                "NaN immunity",
                layout.prepare_subject(layout.partition_of("nf", PARTITIONS)),
                encoded(nan_immunity),
                Expect.BAD_REQUEST,
                headers,
            ),
            Request(
                "inf immunity",
                layout.prepare_subject(layout.partition_of("nf2", PARTITIONS)),
                encoded(inf_immunity),
                Expect.BAD_REQUEST,
                headers,
            ),
        ]
        await assert_survives(bus, batch)


@pytest.mark.parametrize(
    "case",
    [
        "body near max_payload",
        "headers near 64 KiB",
        "headers over 64 KiB",
        "key over 64 KiB",
        "long names",
    ],
)
async def test_sizes_at_the_limits(open_bus: OpenBus, case: str) -> None:
    """Refused with bad_request, or accepted and then committed and delivered intact."""
    async with open_bus() as bus:
        limit = bus.nc.max_payload
        txid = {"long names": "L" * 4000}.get(case, f"size-{case.split()[0]}")
        message = {
            "body near max_payload": {"body": b"b" * (limit - 600)},
            "headers near 64 KiB": {"properties": {"p": "v" * 60_000}},
            "headers over 64 KiB": {"properties": {"p": "v" * 40_000, "q": "w" * 40_000}},
            "key over 64 KiB": {"keys": ["k" * 70_000]},
            "long names": {"topic": "T" * 3000, "tag": "g" * 3000},
        }[case]
        flow = Flow(
            case,
            layout.partition_of(txid, PARTITIONS),
            prepare(txid, **message),
            Verdict.MAYBE,
            Decision.COMMIT,
        )
        await assert_survives(bus, [flow], restart="kill")
