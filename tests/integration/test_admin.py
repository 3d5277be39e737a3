"""The operator commands (`txactors txn ...` and txactors.ops.txn) against a real coordinator.

Transactions are prepared in raw protocol; no producer serves check-backs, so with FAST timing
and check_max=1 a transaction whose halves allow an early check is discarded within a second,
while one with a long check immunity stays prepared for the whole test.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
import time
from typing import Any

import msgspec
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from nats.aio.client import Client
from rich.console import Console
from structlog.testing import capture_logs
from typer.testing import CliRunner

from tests.support.txn import FAST, CoordinatorClient, message, topic_ids
from tests.support.wait import eventually
from txactors.cli import app
from txactors.coordinator import CoordinatorConfig, TxnState
from txactors.coordinator.options import CoordinatorOptions
from txactors.coordinator.service import run_coordinator
from txactors.errors import CommandError, ConfigError
from txactors.observe.logs import configure_logging
from txactors.ops import txn as admin
from txactors.wire import layout
from txactors.wire.protocol import PROTOCOL_VERSION, ListTransactions, TransactionInfo

PENDING = 600.0
"""Check immunity that keeps a transaction prepared (unchecked) for the whole test."""
LONG = 20_000.0
"""A check immunity that outlasts an hour's jump of the coordinator's clock."""


async def _wait_for_state(nc: Client, txid: str, state: str) -> TransactionInfo:
    return await eventually(
        lambda: admin.show(nc, txid), until=lambda info: info.state == state, what=f"{txid} {state}"
    )


def _text(renderable: object) -> str:
    console = Console(file=io.StringIO(), width=200)
    console.print(renderable)
    assert isinstance(console.file, io.StringIO)
    return console.file.getvalue()


async def test_list_show_resume_commit_and_rollback(private_nc: Client) -> None:
    config = CoordinatorConfig(check_max=1, **FAST)
    async with run_coordinator(private_nc, config=config):
        client = CoordinatorClient(private_nc)
        await client.prepare("pending", message(check_immunity=PENDING))
        await client.prepare(
            "two-topics",
            message(topic="payments", check_immunity=PENDING),
            message(check_immunity=PENDING),
            group="billing",
        )
        await client.prepare("lost-1", message())
        await client.prepare("lost-2", message())
        lost = await _wait_for_state(private_nc, "lost-1", "discarded")
        await _wait_for_state(private_nc, "lost-2", "discarded")
        assert (lost.check_times, lost.last_check, lost.discard_reason) == (
            1,
            "no_responders",
            "check_max",
        )
        assert lost.next_check_at is None

        found = await admin.list_transactions(private_nc)
        assert [(t.txid, t.state) for t in found] == [
            ("pending", "prepared"),
            ("two-topics", "prepared"),
            ("lost-1", "discarded"),
            ("lost-2", "discarded"),
        ], "oldest first"
        discarded = await admin.list_transactions(private_nc, states=["discarded"])
        assert [t.txid for t in discarded] == ["lost-1", "lost-2"]
        table = _text(admin.render_list(found))
        assert "billing" in table and "payments" in table and "no_responders" in table

        info = await admin.show(private_nc, "two-topics")
        assert (info.state, info.group, info.producer, info.topics) == (
            "prepared",
            "billing",
            "p1",
            ["orders", "payments"],
        )
        assert len(info.half_seqs) == 2 and info.check_times == 0
        assert info.next_check_at is not None and info.next_check_at > info.born + PENDING - 1
        assert "checker gave up" in _text(admin.render_detail(lost))

        # Resume: back to prepared, checks start again (here they fail and discard it again).
        assert (await admin.resume(private_nc, "lost-2")).state == "prepared"

        # Force-commit a discarded transaction: its message reaches the topic.
        assert (await admin.commit(private_nc, "lost-1")).state == "committed"
        assert await topic_ids(private_nc, "orders") == ["lost-1:0"]

        # Force-rollback a pending one: nothing of it is ever delivered.
        assert (await admin.rollback(private_nc, "two-topics")).state == "rolled_back"
        assert await topic_ids(private_nc, "payments") == []

        refused = [
            (admin.rollback(private_nc, "lost-1"), "conflict", "lost-1 is committed"),
            (admin.resume(private_nc, "two-topics"), "conflict", "is rolled_back"),
            (admin.commit(private_nc, "nope"), "not_found", "no transaction nope"),
            (admin.show(private_nc, "lost-1"), "not_found", "it is committed"),
        ]
        for request, code, text in refused:
            with pytest.raises(CommandError) as error:
                await request
            assert error.value.code == code and text in error.value.message, error.value
        assert [t.txid for t in await admin.list_transactions(private_nc)] == ["pending", "lost-2"]
        assert await topic_ids(private_nc, "orders") == ["lost-1:0"]


async def test_list_merges_partitions_and_commands_find_the_owner(private_nc: Client) -> None:
    partitions = 3
    txids = [f"t{i}" for i in range(8)]
    assert len({layout.partition_of(t, partitions) for t in txids}) == partitions
    options = CoordinatorOptions(partitions=partitions)
    async with run_coordinator(private_nc, config=CoordinatorConfig(), options=options):
        for txid in txids:
            await CoordinatorClient(private_nc, layout.partition_of(txid, partitions)).prepare(
                txid, message()
            )
        found = await admin.list_transactions(private_nc, partitions=partitions)
        assert [t.txid for t in found] == txids
        first = await admin.find_transactions(
            private_nc, ListTransactions(limit=3, version=PROTOCOL_VERSION), partitions=partitions
        )
        assert ([t.txid for t in first.transactions], first.more) == (txids[:3], 5)
        for txid in txids:
            assert (await admin.show(private_nc, txid, partitions=partitions)).txid == txid
        assert (await admin.commit(private_nc, "t5", partitions=partitions)).state == "committed"
        assert await topic_ids(private_nc, "orders") == ["t5:0"]


async def test_filters_are_applied_by_the_coordinator(private_nc: Client) -> None:
    later = 0.0  # the coordinator's clock runs `later` seconds ahead of the wall clock
    config = CoordinatorConfig(check_max=1, max_immunity=LONG, **FAST)
    async with run_coordinator(private_nc, config=config, clock=lambda: time.time() + later):
        client = CoordinatorClient(private_nc)
        await client.prepare("old-g", message(check_immunity=LONG))
        await client.prepare("old-b", message("payments", check_immunity=LONG), group="billing")
        later = 3600.0
        await client.prepare("new-g", message(check_immunity=LONG))
        await client.prepare("lost-g1", message())
        await client.prepare("lost-g2", message())
        await client.prepare("lost-b", message("payments"), group="billing")
        for txid in ("lost-g1", "lost-g2", "lost-b"):
            await _wait_for_state(private_nc, txid, "discarded")

        async def found(**where: Any) -> tuple[list[str], int]:
            reply = await admin.find_transactions(
                private_nc, ListTransactions(**where, version=PROTOCOL_VERSION)
            )
            return [t.txid for t in reply.transactions], reply.more

        assert await found(older_than=1800) == (["old-g", "old-b"], 0)
        assert await found(group="g") == (["old-g", "new-g", "lost-g1", "lost-g2"], 0)
        assert await found(topic="payments") == (["old-b", "lost-b"], 0)
        assert await found(group="g", states=["discarded"]) == (["lost-g1", "lost-g2"], 0)
        assert await found(group="billing", older_than=1800, topic="orders") == ([], 0)
        assert await found(limit=2) == (["old-g", "old-b"], 4)
        with pytest.raises(CommandError, match=r"\$\.older_than"):
            await admin.find_transactions(
                private_nc, ListTransactions(older_than=-1, version=PROTOCOL_VERSION)
            )


async def test_bulk_resolution_reports_each_and_every_action_is_logged(
    private_nc: Client,
) -> None:
    config = CoordinatorConfig(check_max=1, **FAST)
    async with run_coordinator(private_nc, config=config):
        client = CoordinatorClient(private_nc)
        await client.prepare("pending", message(check_immunity=PENDING))
        for txid in ("lost-1", "lost-2"):
            await client.prepare(txid, message())
            await _wait_for_state(private_nc, txid, "discarded")
        configure_logging("INFO")  # the conftest's WARNING would drop the successful ones
        with capture_logs() as logs:
            results = await admin.resolve_all(
                private_nc,
                ["lost-1", "nope", "lost-2"],
                admin.Resolution.COMMIT,
                batch="bulk-1",
            )
            assert (await admin.rollback(private_nc, "pending")).state == "rolled_back"
            with pytest.raises(CommandError):
                await admin.resume(private_nc, "lost-1")
        assert [(r.txid, r.state, r.error) for r in results] == [
            ("lost-1", "committed", None),
            ("nope", None, "not_found: no transaction nope"),
            ("lost-2", "committed", None),
        ]
        assert sorted(await topic_ids(private_nc, "orders")) == ["lost-1:0", "lost-2:0"]
    actions = [
        (e["txid"], e["action"], e["result"], e["batch"], e["partition"])
        for e in logs
        if e["event"] == "operator_action"
    ]
    assert sorted(actions[:3]) == [
        ("lost-1", "commit", "committed", "bulk-1", 0),
        ("lost-2", "commit", "committed", "bulk-1", 0),
        ("nope", "commit", "not_found", "bulk-1", 0),
    ]
    assert actions[3:] == [
        ("pending", "rollback", "rolled_back", None, 0),
        ("lost-1", "resume", "conflict", None, 0),
    ]


async def test_no_coordinator_is_reported_as_such(private_nc: Client) -> None:
    with pytest.raises(admin.CoordinatorUnavailable, match="txactors coordinator"):
        await admin.list_transactions(private_nc)
    with pytest.raises(ValueError, match="partitions"):
        await admin.show(private_nc, "t1", partitions=0)


async def _cli(*args: str, stdin: bytes = b"") -> tuple[int, str, str]:
    """Run the real `txactors` in a subprocess, without blocking this loop's coordinator."""
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "txactors.cli",
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(process.communicate(stdin), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_cli_against_a_running_coordinator(private_nc: Client) -> None:
    assert private_nc.connected_url is not None
    url = private_nc.connected_url.geturl()
    code, out, err = await _cli("txn", "list", "--url", url, "--json")
    assert code == 2 and "txactors coordinator" in json.loads(out)["error"], out + err

    async with run_coordinator(private_nc, config=CoordinatorConfig(transaction_timeout=60)):
        await CoordinatorClient(private_nc).prepare("t1", message())

        code, out, err = await _cli("txn", "list", "--url", url, "--json")
        assert code == 0, err
        [info] = msgspec.json.decode(out, type=list[TransactionInfo])
        assert (info.txid, info.state, info.topics) == ("t1", "prepared", ["orders"])

        code, _, err = await _cli("txn", "commit", "nope", "--yes", "--url", url)
        assert code == 1 and "not_found: no transaction nope" in err, err

        code, _, err = await _cli("txn", "rollback", "t1", "--url", url, stdin=b"n\n")
        assert code == 1 and "left as it is" in err, err
        assert (await admin.show(private_nc, "t1")).state == "prepared"

        code, out, err = await _cli("txn", "rollback", "t1", "--url", url, stdin=b"y\n")
        assert (code, out) == (0, "t1: rolled_back\n"), err
        assert "group" in err, "the transaction is shown before the question"


def test_cli_without_a_server_url_is_a_usage_error() -> None:
    result = CliRunner().invoke(app, ["txn", "list"], env={"NATS_URL": None})
    assert result.exit_code == 2
    assert "no NATS server given: pass --url" in result.output

    result = CliRunner().invoke(app, ["txn", "list", "--state", "bogus", "--url", "nats://x:1"])
    assert result.exit_code == 2 and "discarded" in result.output


def test_admin_config_needs_a_url_and_takes_it_from_the_environment() -> None:
    with pytest.raises(ConfigError, match="--url"):
        admin.admin_config(environ={})
    assert admin.admin_config(environ={"NATS_URL": "nats://n1:4222"}).url == "nats://n1:4222"
    assert admin.admin_config("nats://n2:4222", environ={"NATS_URL": "x"}).url == "nats://n2:4222"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (-3, "0s"),
        (0.4, "<1s"),
        (42.9, "42s"),
        (192, "3m 12s"),
        (5 * 3600 + 7 * 60 + 9, "5h 07m"),
        (2 * 86400 + 3 * 3600 + 59, "2d 3h"),
    ],
)
def test_human_duration(seconds: float, text: str) -> None:
    assert admin.human_duration(seconds) == text


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90), ("90s", 90), ("10m", 600), ("1h30m", 5400), ("2d 3h", 183_600), (" 1.5H ", 5400)],
)
def test_durations_are_read_as_operators_write_them(text: str, seconds: float) -> None:
    assert admin.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "10x", "-5", "nan", "inf", "5m soon", "m", "1e400"])
def test_what_is_no_duration_says_how_to_write_one(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration"):
        admin.parse_duration(text)


@given(st.floats(0, 10**8))
def test_a_duration_as_shown_reads_back_within_its_precision(seconds: float) -> None:
    shown = admin.human_duration(seconds)
    assume(shown != "<1s")
    precision = 1 if seconds < 3600 else 60 if seconds < 86_400 else 3600
    assert admin.parse_duration(shown) <= seconds < admin.parse_duration(shown) + precision


def test_rendering_is_relative_to_now_and_every_state_is_explained() -> None:
    assert set(admin.STATE_MEANINGS) == set(TxnState)
    info = TransactionInfo(
        txid="t1",
        state="prepared",
        group="g",
        producer="p1",
        topics=["orders"],
        half_seqs=[7],
        born=1000.0,
        check_times=2,
        last_check="unknown",
        next_check_at=1250.0,
    )
    row = _text(admin.render_list([info], now=1192.0))
    assert "3m 12s" in row and "58s" in row and "unknown" in row
    assert admin.next_check(info, now=1300.0) == "due"
    checking = msgspec.structs.replace(info, state="checking", next_check_at=None)
    assert admin.next_check(checking, now=1300.0) == "in flight"
    detail = _text(admin.render_detail(info, now=1192.0))
    assert "1970-01-01T00:16:40+00:00 (3m 12s ago)" in detail and "waiting for" in detail
    assert msgspec.json.decode(admin.to_json(info), type=TransactionInfo) == info
