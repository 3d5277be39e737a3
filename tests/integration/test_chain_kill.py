"""A handler that sends, its process killed at each step (issue 35): on SQLite, PostgreSQL
and MariaDB, the input's change is applied once and its message reaches the next group once.

The handler's process (tests/peers/chained_handler.py) dies at a fault point of its first
handling; it is started again (a restart), the input is redelivered, and another instance of
its group in this process answers check-backs meanwhile. The next group ("notifications")
applies what reaches it once (`apply_once_sqlite`), and the topic itself is read for
duplicates: exactly one message, of the one attempt whose change committed.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aiosqlite
import anyio
import anyio.abc
import nats
import pytest

from tests.peers.chained_handler import INPUT, OUTPUT
from tests.support.txlogs import Backend, backend
from tests.support.txn import FAST, topic_ids
from tests.support.wait import eventually
from txactors import ConsumedMessage, Consumer, Decision, TransactionProducer, TxMessage
from txactors.app.chain import chained_txid
from txactors.consumer.idempotent import apply_once_sqlite
from txactors.coordinator import CoordinatorConfig
from txactors.coordinator.service import run_coordinator
from txactors.faults import CRASH_EXIT_CODE, FAULT_ENV, FaultPoint
from txactors.ops.txn import list_transactions

pytestmark = [pytest.mark.postgres, pytest.mark.mariadb, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SETTLE = 60.0

KILL_POINTS = [  # in their order
    FaultPoint.AFTER_TXLOG_RECORD,  # the first send: log row written, no prepare yet
    FaultPoint.AFTER_LOCAL_WORK,  # the prepare out, not awaited
    FaultPoint.AFTER_PREPARE,  # halves stored, no local commit
    FaultPoint.AFTER_LOCAL_COMMIT,  # committed locally, no end
    FaultPoint.AFTER_END,  # ended, the input not acked
]
COMMITTED_FIRST = {FaultPoint.AFTER_LOCAL_COMMIT, FaultPoint.AFTER_END}
"""The points after which the first attempt's change is committed: it is the one sent."""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend_name", ["sqlite", "asyncpg", "mariadb"])
@pytest.mark.parametrize("point", KILL_POINTS)
async def test_a_handler_killed_at_each_step_applies_once_and_sends_once(
    make_nats_server: Any, tmp_path: Path, backend_name: str, point: FaultPoint
) -> None:
    server = await make_nats_server()
    nc = await nats.connect(server.url)
    db: Backend = backend(backend_name, tmp_path)
    group = f"logistics-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NATS_URL": server.url}
    command = [sys.executable, "-m", "tests.peers.chained_handler", server.url]
    command += [backend_name, str(tmp_path), group]
    notified: list[str] = []
    try:
        survivor = await db.instance(group)  # another instance of the group: its checker
        await survivor.create_applied_table()
        async with (
            aiosqlite.connect(tmp_path / "notifications.db") as notifications,
            run_coordinator(nc, config=CoordinatorConfig(**FAST)),
            TransactionProducer(nc, group, survivor.check),
            TransactionProducer(nc, "shop", lambda view: Decision.COMMIT) as shop,
        ):

            async def notify(message: ConsumedMessage) -> None:
                async def work(conn: aiosqlite.Connection) -> None:
                    notified.append(message.body.decode())

                await apply_once_sqlite(notifications, "notifications", message.msg_id, work)

            async with Consumer(nc, OUTPUT, "notifications", notify, pull_expires=0.2):
                async with shop.begin() as txn:
                    await txn.send(TxMessage(INPUT, b"order 42 paid"))
                input_id = f"{txn.txid}:0"
                attempts = [chained_txid(group, input_id, n) for n in range(1, 8)]

                crashing = await anyio.open_process(
                    command, cwd=ROOT, env={**env, FAULT_ENV: point}
                )
                first = await _lines_until_dead(crashing)
                assert not any(line.startswith("HANDLED") for line in first), first

                restarted = await anyio.open_process(command, cwd=ROOT, env=env)
                handled: list[str] = []
                try:
                    async with anyio.create_task_group() as tasks:
                        tasks.start_soon(_read_lines, restarted, handled)
                        await eventually(  # the redelivery handled and acked, all settled
                            lambda: list_transactions(nc),
                            until=lambda open_ones: (
                                not open_ones
                                and notified
                                and any(line.startswith("HANDLED") for line in handled)
                            ),
                            timeout=SETTLE,
                            what="the input handled again, every transaction settled",
                        )
                        tasks.cancel_scope.cancel()
                finally:
                    restarted.send_signal(signal.SIGKILL)
                    await restarted.wait()
                    await restarted.aclose()
                assert [h.split()[1] for h in handled if h.startswith("HANDLED")] == [input_id]
            sent = await topic_ids(nc, OUTPUT)
        committed = [txid for txid in attempts if await db.committed(txid)]
        assert len(committed) == 1, (committed, first)
        assert sent == [f"{committed[0]}:0"], "one message on the topic, the committed attempt's"
        assert notified == [input_id], "applied once by the next group"
        assert (committed[0] == attempts[0]) is (point in COMMITTED_FIRST)
    finally:
        await db.close()
        await nc.close()


async def _lines_until_dead(peer: anyio.abc.Process) -> list[str]:
    """The peer's output once it died at its fault point."""
    assert peer.stdout is not None
    output = b""
    deadline = time.monotonic() + 60
    try:
        with anyio.fail_after(60):
            async for chunk in peer.stdout:
                output += chunk
            code = await peer.wait()
    finally:
        if peer.returncode is None:
            peer.kill()
        await peer.aclose()
    assert time.monotonic() < deadline
    lines = output.decode().splitlines()
    assert code == CRASH_EXIT_CODE, lines
    return lines


async def _read_lines(peer: anyio.abc.Process, lines: list[str]) -> None:
    assert peer.stdout is not None
    buffer = b""
    async for chunk in peer.stdout:
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        lines += [line.decode() for line in complete]
