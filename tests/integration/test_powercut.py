"""Power cuts under load: what was acknowledged survives, the rest resolves.

Every service writes to the power-cut disk (tests/support/powercut): nats-server's store and
the producers' and banks' SQLite files. Under load, the power is cut at a random (seeded)
moment: every process dies at once and the disk keeps only what was fsynced. Then the
machine restarts, check-backs and redeliveries settle what was in flight, and the outcome
is checked against what the processes had been promised before the cut. The lazy run
shows the disk bites: without fsync before the ack, acknowledged commits are lost.
"""

from __future__ import annotations

import os
import random
import sqlite3
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, closing
from pathlib import Path

import anyio
import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client

from apps.common.db import SqliteDatabase
from apps.common.drain import wait_drained
from apps.transfer.bank import ALIPAY, YUEBAO, Bank
from apps.transfer.messages import RECEIVER_GROUP
from apps.transfer.messages import TOPIC as TRANSFERS
from apps.transfer.reconcile import reconcile
from tests.peers.powercut_producer import TOPIC
from tests.support.powercut.fixture import REQUIRE_ENV, PowerCut, unavailable
from tests.support.powercut.machine import Machine
from tests.support.txn import topic_ids
from tests.support.wait import eventually
from txactors.ops.txn import CoordinatorUnavailable, list_transactions

SEED = int(os.environ.get("TXACTORS_POWERCUT_SEED", "20261122"))
CUTS = int(os.environ.get("TXACTORS_POWERCUT_CUTS", "3"))
"""Cuts per run: 3 keeps CI's share near a minute; set more for a longer hunt (CI runs the
`slow` tests too, so a many-cut variant there would cost every run minutes)."""
SETTLE = 45.0
"""Seconds a restarted machine gets to resolve everything in flight at the cut."""

pytestmark = pytest.mark.timeout(600)


def _unable(reason: str) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"power-cut tests required ({REQUIRE_ENV}=1) but {reason}")
    pytest.skip(reason)


@pytest_asyncio.fixture
async def power_cut(tmp_path: Path) -> AsyncIterator[PowerCut]:
    reason = unavailable()
    if reason is not None:
        _unable(reason)
    disk = PowerCut(tmp_path)
    try:
        await disk.__aenter__()
    except (RuntimeError, TimeoutError) as error:
        _unable(f"cannot mount a FUSE disk here: {error}")
    try:
        yield disk
    finally:
        await disk.__aexit__(None, None, None)


async def _connect(machine: Machine) -> Client:
    return await nats.connect(machine.url, max_reconnect_attempts=-1)


async def _run_load(machine: Machine, name: str, rng: random.Random) -> None:
    """Let `name` commit a few transactions, then a random while more: the cut's moment."""
    before = len(machine.lines(name, "COMMITTED"))
    await eventually(
        lambda: len(machine.lines(name, "COMMITTED")) >= before + 10,
        timeout=30,
        what=f"{name} committed ten",
        explain=lambda: machine.output(name),
    )
    await anyio.sleep(rng.uniform(0.0, 1.5))  # the scenario: the cut comes at a random moment


# -- the disk itself, and SQLite on it ------------------------------------------------------


async def test_the_disk_keeps_only_what_was_fsynced(power_cut: PowerCut) -> None:
    """Reads see every write at once; after the cut, only what was fsynced is there."""
    root = power_cut.mountpoint
    synced = os.open(root / "synced", os.O_CREAT | os.O_WRONLY)
    os.write(synced, b"kept")
    os.fsync(synced)  # a new file's fsync persists its name too (ext4 does)
    os.write(synced, b" and lost")
    os.close(synced)
    (root / "never-synced").write_bytes(b"lost")
    (root / "synced").rename(root / "renamed")  # no directory fsync: the rename is lost
    assert (root / "renamed").read_bytes() == b"kept and lost"
    await power_cut.cut()
    assert sorted(p.name for p in root.iterdir()) == ["synced"]
    assert (root / "synced").read_bytes() == b"kept"


SQLITE_WRITER = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute(f"PRAGMA journal_mode={sys.argv[2]}")
conn.execute(f"PRAGMA synchronous={sys.argv[3]}")
conn.execute("CREATE TABLE t (x INTEGER)")
conn.execute("INSERT INTO t VALUES (1)")
conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # in WAL mode, 1 is in the database file
conn.execute("INSERT INTO t VALUES (2)")  # the commit the cut comes right after
print("committed", flush=True)
time.sleep(60)  # open, as a service's connection is, until the cut kills it
"""
SQLITE_CASES = [
    ("DELETE", "FULL", False),
    ("DELETE", "EXTRA", True),
    ("WAL", "FULL", True),
    ("WAL", "NORMAL", False),
]


@pytest.mark.parametrize(("journal", "synchronous", "survives"), SQLITE_CASES)
async def test_a_returned_commit_survives_a_cut_only_when_synced(
    power_cut: PowerCut, journal: str, synchronous: str, survives: bool
) -> None:
    """A commit in rollback-journal mode ends by deleting the journal; with synchronous=FULL
    that deletion is not synced, so a cut right after brings the journal back and SQLite rolls
    the commit back on the next open (EXTRA syncs the directory after the deletion). In WAL
    mode, FULL syncs the WAL on every commit; NORMAL leaves it to the checkpoint."""
    path = power_cut.mountpoint / "db.sqlite"
    writer = power_cut.track(
        await anyio.open_process(
            [sys.executable, "-c", SQLITE_WRITER, str(path), journal, synchronous]
        )
    )
    assert writer.stdout is not None
    with anyio.fail_after(30):
        assert (await writer.stdout.receive()).startswith(b"committed")
    await power_cut.cut()
    with closing(sqlite3.connect(path)) as conn:
        rows = [x for (x,) in conn.execute("SELECT x FROM t ORDER BY x")]
    assert rows == ([1, 2] if survives else [1])


# -- transactions: commit, rollback, UNKNOWN then check-back -----------------------------


def _ledger(path: Path) -> set[str]:
    with closing(sqlite3.connect(path, timeout=30)) as conn:
        return {row[0] for row in conn.execute("SELECT txid FROM ledger")}


async def _settled_transactions(
    machine: Machine, ledger: Path
) -> tuple[set[str], set[str], list[object]]:
    """(txids on the topic, txids in the ledger, transactions still listed) once nothing
    is open and the two sets agree, or as they are when SETTLE runs out."""
    nc = await _connect(machine)
    try:
        deadline = time.monotonic() + SETTLE
        while True:
            try:
                listed: list[object] = list(await list_transactions(nc))
            except CoordinatorUnavailable:  # its partitions wait for the dead one's lease
                if time.monotonic() > deadline:
                    raise
                await anyio.sleep(0.2)  # not a wait to fail: settling ends either way
                continue
            on_topic = {msg_id.split(":")[0] for msg_id in await topic_ids(nc, TOPIC)}
            local = _ledger(ledger)
            if (not listed and on_topic == local) or time.monotonic() > deadline:
                return on_topic, local, listed
            await anyio.sleep(0.2)  # not a wait to fail: settling ends either way
    finally:
        await nc.close()


async def _transactions_through_cuts(
    power_cut: PowerCut,
    logs: Path,
    *,
    sync: str | None,
    setting: str,
    cuts: int,
    peer: str = "tests.peers.powercut_producer",
) -> list[str]:
    """Run the producer (`peer`) under load and cut `cuts` times; after each restart, what
    the invariants found wrong (empty: nothing)."""
    machine = Machine(power_cut, logs, sync)
    ledger = power_cut.mountpoint / "ledger.db"
    rng = random.Random(SEED)
    problems: list[str] = []
    for cut in range(1, cuts + 1):
        await machine.boot()
        await machine.start_peer("producer", peer, str(ledger), "load", setting, str(cut))
        await _run_load(machine, "producer", rng)
        await power_cut.cut()

        await machine.boot()
        await machine.start_peer("producer", peer, str(ledger), "answer", setting, "0")
        on_topic, local, listed = await _settled_transactions(machine, ledger)
        confirmed = set(machine.lines("producer", "COMMITTED"))
        where = f"after cut {cut} (seed {SEED})"
        if lost := confirmed - on_topic:
            problems.append(f"{where}: {len(lost)} of {len(confirmed)} confirmed commits lost")
        if unsent := local - on_topic:
            problems.append(f"{where}: {len(unsent)} local commits without their message")
        if invented := on_topic - local:
            problems.append(f"{where}: {len(invented)} messages without a local commit")
        if listed:
            problems.append(f"{where}: {len(listed)} transactions still open: {listed[:3]}")
        if not problems:
            assert confirmed, "the run committed nothing: it proved nothing"
        await power_cut.cut()  # the quiet machine goes down too: nothing may be lost then
    return problems


async def test_committed_transactions_survive_power_cuts(power_cut: PowerCut, tmp_path: Path):
    problems = await _transactions_through_cuts(
        power_cut, tmp_path / "logs", sync="always", setting="durable", cuts=CUTS
    )
    assert problems == []


async def test_the_transaction_log_is_as_durable_as_the_business_rows(
    power_cut: PowerCut, tmp_path: Path
):
    """The producer sends with `TxLog.send_in_transaction`, its log in the same SQLite file
    as the business rows: after each cut the check-backs, answered from the log alone,
    deliver exactly the business changes that survived."""
    problems = await _transactions_through_cuts(
        power_cut,
        tmp_path / "logs",
        sync="always",
        setting="durable",
        cuts=CUTS,
        peer="tests.peers.powercut_txlog",
    )
    assert problems == []


async def test_lazy_flush_loses_acknowledged_commits(power_cut: PowerCut, tmp_path: Path):
    """The control: with nats-server's default flush (every two minutes) and SQLite's WAL
    with synchronous=NORMAL, the same cut loses commits the coordinator had confirmed."""
    problems = await _transactions_through_cuts(
        power_cut, tmp_path / "logs", sync=None, setting="lazy", cuts=1
    )
    assert any("confirmed commits lost" in problem for problem in problems), problems


# -- the transfer flow: two banks, producer, consumer ------------------------------------


async def _open_bank(name: str, directory: Path) -> Bank:
    import aiosqlite

    path = directory / f"{name}.db"
    conn = await aiosqlite.connect(path, isolation_level=None, timeout=30)
    return Bank(SqliteDatabase(name, path, conn))


async def _books_after_restart(machine: Machine, directory: Path, where: str) -> list[str]:
    nc = await _connect(machine)
    try:
        drained = await wait_drained(nc, [(TRANSFERS, RECEIVER_GROUP)], timeout=SETTLE)
        async with AsyncExitStack() as stack:
            alipay = await _open_bank(ALIPAY, directory)
            stack.push_async_callback(alipay.db.close)
            yuebao = await _open_bank(YUEBAO, directory)
            stack.push_async_callback(yuebao.db.close)
            reconciliation = await reconcile(alipay, yuebao, nc=nc)
            sent = await alipay.sent()
            received = await yuebao.received()
    finally:
        await nc.close()
    problems = [
        f"{where}: {check.section} / {check.name}: expected {check.expected}, got {check.actual}"
        for check in reconciliation.mismatches
    ]
    if not drained:
        problems.append(f"{where}: the pipeline did not drain within {SETTLE}s")
    confirmed = set(machine.lines("alipay", "COMMITTED"))
    if lost := confirmed - sent.keys():
        problems.append(f"{where}: {len(lost)} confirmed transfers not in alipay's books")
    if uncredited := {id_ for id_ in confirmed if id_ not in received}:
        problems.append(f"{where}: {len(uncredited)} confirmed transfers never credited")
    if not problems:
        assert confirmed, "no transfer committed: the run proved nothing"
    return problems


async def _transfers_through_cuts(power_cut: PowerCut, logs: Path, cuts: int) -> list[str]:
    machine = Machine(power_cut, logs, "always")
    books = power_cut.mountpoint / "banks"
    books.mkdir()
    rng = random.Random(SEED)
    peer = "tests.peers.powercut_bank"
    problems: list[str] = []
    for cut in range(1, cuts + 1):
        await machine.boot()
        await machine.start_peer("yuebao", peer, "receiver", str(books))
        await machine.start_peer("alipay", peer, "sender", str(books), "load", str(cut))
        await _run_load(machine, "alipay", rng)
        await power_cut.cut()

        await machine.boot()
        await machine.start_peer("yuebao", peer, "receiver", str(books))
        await machine.start_peer("alipay", peer, "sender", str(books), "answer", "0")
        problems += await _books_after_restart(machine, books, f"after cut {cut} (seed {SEED})")
        await power_cut.cut()
    return problems


async def test_transfer_books_balance_after_power_cuts(power_cut: PowerCut, tmp_path: Path):
    assert await _transfers_through_cuts(power_cut, tmp_path / "logs", CUTS) == []
