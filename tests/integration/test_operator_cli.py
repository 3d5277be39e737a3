"""The operator commands as an operator runs them: `txactors txn list/resolve`, `dlq`, `lease`,
`--version` and `--log-format`, each a real `txactors` process against a real coordinator."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import signal
import sys
from importlib.metadata import version
from pathlib import Path

import anyio
import msgspec
import pytest
from nats.aio.client import Client

from tests.support.txn import FAST, CoordinatorClient, message, topic_ids
from tests.support.wait import eventually
from txactors.consumer import ConsumedMessage
from txactors.consumer.dlq import dead_letter
from txactors.coordinator import CoordinatorConfig
from txactors.coordinator.options import CoordinatorOptions
from txactors.coordinator.service import run_coordinator
from txactors.errors import ConfigError
from txactors.nats.topics import ensure_dlq_stream, ensure_topic_stream
from txactors.observe.logs import LOG_FORMAT_ENV, configure_logging
from txactors.ops import txn as admin
from txactors.wire import layout
from txactors.wire.protocol import TransactionInfo

ROOT = Path(__file__).resolve().parents[2]
PENDING = 600.0


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TXACTORS_", "NATS_"))}
    return {**env, "PYTHONPATH": str(ROOT)}


async def _start(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "txactors.cli",
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=_env(),
        cwd=ROOT,
    )


async def _cli(*args: str, stdin: bytes = b"") -> tuple[int, str, str]:
    process = await _start(*args)
    out, err = await asyncio.wait_for(process.communicate(stdin), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def _url(nc: Client) -> str:
    assert nc.connected_url is not None
    return nc.connected_url.geturl()


async def _discarded(nc: Client, *txids: str) -> None:
    for txid in txids:
        await eventually(
            lambda txid=txid: admin.show(nc, txid),
            until=lambda info: info.state == "discarded",
            what=f"{txid} discarded",
        )


async def test_txn_list_filters_and_a_confirmed_bulk_commit(private_nc: Client) -> None:
    url = _url(private_nc)
    async with run_coordinator(private_nc, config=CoordinatorConfig(check_max=1, **FAST)):
        client = CoordinatorClient(private_nc)
        await client.prepare("pending", message(check_immunity=PENDING))
        await client.prepare("lost-1", message())
        await client.prepare("lost-2", message())
        await client.prepare("lost-b", message(), group="billing")
        await _discarded(private_nc, "lost-1", "lost-2", "lost-b")

        by_group, too_old, bad_age, unfiltered = await asyncio.gather(
            _cli("txn", "list", "--url", url, "--group", "g", "--state", "discarded", "--json"),
            _cli("txn", "list", "--url", url, "--older-than", "1h"),
            _cli("txn", "list", "--url", url, "--older-than", "soon"),
            _cli("txn", "resolve", "--url", url, "--commit"),
        )
        code, out, err = by_group
        assert code == 0, err
        listed = msgspec.json.decode(out, type=list[TransactionInfo])
        assert [t.txid for t in listed] == ["lost-1", "lost-2"]
        code, out, err = too_old
        assert (code, out) == (0, "no open or discarded transaction matches (older than 1h 00m)\n")
        code, _, err = bad_age
        assert code == 2 and "--older-than" in err and "10m" in err, err
        code, _, err = unfiltered
        assert code == 2 and "at least one of --state" in err, err

        resolve = ("txn", "resolve", "--url", url, "--group", "g", "--state", "discarded")
        code, _, err = await _cli(*resolve, "--commit", stdin=b"n\n")
        assert code == 1 and "nothing was changed" in err, err
        assert "lost-1" in err and "lost-2" in err and "lost-b" not in err, "shown first"
        assert await topic_ids(private_nc, "orders") == []

        # Someone rolls lost-2 back while the question is on screen: the bulk commit does the
        # rest, reports each one, and fails.
        process = await _start(*resolve, "--commit")
        assert process.stderr is not None and process.stdin is not None
        with anyio.fail_after(20):
            seen = b""
            while b"[y/N]" not in seen:
                chunk = await process.stderr.read(4096)
                assert chunk, seen.decode()
                seen += chunk
        assert b"Commit these 2 transaction(s)?" in seen
        await admin.rollback(private_nc, "lost-2")
        out_bytes, err_bytes = await asyncio.wait_for(process.communicate(b"y\n"), 60)
        assert process.returncode == 1, err_bytes.decode()
        assert out_bytes.decode().splitlines() == ["lost-1: committed"]
        assert (
            "error: lost-2: conflict: transaction lost-2 is rolled_back; it cannot commit\n"
            in err_bytes.decode()
        )
        assert "1 done, 1 failed" in err_bytes.decode()
        assert await topic_ids(private_nc, "orders") == ["lost-1:0"]

        code, out, err = await _cli(
            "txn", "resolve", "--url", url, "--group", "billing", "--resume", "--yes", "--json"
        )
        assert code == 0, err
        assert json.loads(out) == [{"txid": "lost-b", "state": "prepared", "error": None}]


async def test_dlq_list_show_and_replay(private_nc: Client) -> None:
    url = _url(private_nc)
    js = private_nc.jetstream()
    await ensure_topic_stream(js, "orders")
    await ensure_dlq_stream(js, "g")
    for txid, body in (("t1", b"first body"), ("t2", b"second body")):
        headers = {layout.MSG_ID_HEADER: f"{txid}:0", layout.TXID_HEADER: txid}
        ack = await js.publish(layout.topic_subject("orders"), body, headers=headers)
        consumed = ConsumedMessage(
            topic="orders",
            tag=None,
            keys=(),
            txid=txid,
            msg_id=f"{txid}:0",
            body=body,
            headers=headers,
            deliveries=17,
            stream_seq=ack.seq,
            committed_at=None,
            subject=layout.topic_subject("orders"),
        )
        await dead_letter(js, "g", consumed, KeyError("sku"), max_payload=private_nc.max_payload)

    groups, listed, shown, nothing, nobody = await asyncio.gather(
        _cli("dlq", "list", "--url", url),
        _cli("dlq", "list", "g", "--url", url, "--json"),
        _cli("dlq", "show", "g", "2", "--url", url),
        _cli("dlq", "replay", "g", "--url", url),
        _cli("dlq", "list", "nobody", "--url", url),
    )
    code, out, err = groups
    assert code == 0 and "g" in out and "2" in out, err
    code, out, err = listed
    assert code == 0, err
    entries = json.loads(out)["entries"]
    assert [(e["seq"], e["txid"], e["error"]) for e in entries] == [
        (1, "t1", "KeyError: 'sku'"),
        (2, "t2", "KeyError: 'sku'"),
    ]
    code, out, err = shown
    assert code == 0 and "second body" in out and "Txn-Deliveries" in out, err
    code, _, err = nothing
    assert code == 2 and "--all" in err, err
    code, _, err = nobody
    assert code == 1 and "no dead-letter stream" in err, err
    code, out, err = await _cli("dlq", "replay", "g", "--all", "--url", url, stdin=b"y\n")
    assert code == 0, err
    assert "Replay all 2 dead letter(s) of group g" in err
    assert out.splitlines() == [
        "DLQ_g entry 1: replayed to TOPIC_orders seq 3",
        "DLQ_g entry 2: replayed to TOPIC_orders seq 4",
    ]
    # Emptied: no entries, and no sequences that read like some (JetStream's first = last + 1).
    (code, out, err), (_, listed_json, _) = await asyncio.gather(
        _cli("dlq", "list", "--url", url), _cli("dlq", "list", "--url", url, "--json")
    )
    assert code == 0 and out.split()[-4:] == ["g", "0", "-", "-"], out + err
    assert json.loads(listed_json) == [
        {"group": "g", "entries": 0, "first_seq": None, "last_seq": None}
    ]
    # Replayed already: an error like every other, and JSON under --json.
    (code, out, err), (code_json, out_json, _) = await asyncio.gather(
        _cli("dlq", "replay", "g", "1", "--url", url),
        _cli("dlq", "replay", "g", "1", "--url", url, "--json"),
    )
    assert (code, out, err) == (
        1,
        "",
        "error: DLQ_g has no entry 1 (replayed or deleted already?)\n",
    )
    assert code_json == 1
    assert json.loads(out_json) == [
        {
            "seq": 1,
            "topic": None,
            "topic_seq": None,
            "duplicate": False,
            "error": "DLQ_g has no entry 1 (replayed or deleted already?)",
        }
    ]


async def test_under_json_every_error_is_json_too(private_nc: Client) -> None:
    """A script reads the answer on stdout: a refusal, a missing stream, a bad flag alike."""
    url = _url(private_nc)
    async with run_coordinator(private_nc):
        answers = await asyncio.gather(
            _cli("txn", "show", "nosuch", "--url", url, "--json"),
            _cli("dlq", "list", "nobody", "--url", url, "--json"),
            _cli("txn", "list", "--state", "bogus", "--url", url, "--json"),
            _cli("txn", "show", "nosuch", "--url", url),
        )
    (missing, missing_out, quiet), (no_dlq, no_dlq_out, _), (bad, bad_out, _) = answers[:3]
    text, text_out, err = answers[3]
    assert (missing, quiet) == (1, ""), quiet
    assert json.loads(missing_out) == {"error": "nosuch: not open here", "code": "not_found"}
    assert no_dlq == 1 and "no dead-letter stream" in json.loads(no_dlq_out)["error"]
    assert bad == 2 and "bogus" in json.loads(bad_out)["error"]
    assert (text, text_out) == (1, "")
    assert err == "error: not_found: nosuch: not open here\n", err


def test_help_shows_flags_without_a_value_type() -> None:
    """`--help`, `--version`, `--json` take no value: help shows none; other options keep theirs."""
    from typer.testing import CliRunner

    from txactors.cli import app

    for command in ([], ["dlq", "replay"], ["txn", "show"]):
        shown = CliRunner().invoke(app, [*command, "--help"], terminal_width=100)
        assert shown.exit_code == 0, shown.output
        assert "<bool>" not in shown.output, shown.output
        assert "--help" in shown.output
    assert "<str>" in shown.output, "an option that takes a value still says which"


async def test_the_sink_script_shows_flags_without_a_value_type() -> None:
    """`python -m spark_sinks`, the script spark-submit runs, shows help as `txactors sink`."""
    for command in ([], ["run"]):
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "spark_sinks", *command, "--help"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**_env(), "COLUMNS": "100"},
            cwd=ROOT,
        )
        out, err = await asyncio.wait_for(process.communicate(), 60)
        shown = out.decode()
        assert process.returncode == 0, err.decode()
        assert "<bool>" not in shown, shown
        assert "--help" in shown
    assert "--once" in shown and "<float>" in shown, "other options still say their type"


async def test_lease_list(private_nc: Client) -> None:
    """Every partition of the published count is listed, the free one too, without a flag."""
    options = CoordinatorOptions(partitions=3, max_partitions=2)
    async with run_coordinator(private_nc, options=options, owner="coord-a"):
        (code, out, err), (wrong, _, refused) = await asyncio.gather(
            _cli("lease", "list", "--url", _url(private_nc), "--json"),
            _cli("lease", "list", "--url", _url(private_nc), "--partitions", "2"),
        )
    assert code == 0, err
    leases = json.loads(out)["leases"]
    assert [lease["partition"] for lease in leases] == [0, 1, 2]
    assert sorted(str(lease["owner"]) for lease in leases) == ["None", "coord-a", "coord-a"]
    assert wrong == 2 and "set to 2 here, but the coordinators use 3" in refused, refused


async def test_version_and_a_bad_log_format() -> None:
    (code, out, _), (bad, _, err) = await asyncio.gather(
        _cli("--version"), _cli("--log-format", "xml", "server")
    )
    assert (code, out) == (0, f"txactors {version('txactors')}\n")
    assert bad == 2 and "--log-format" in err, err


def test_a_bad_log_format_variable_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOG_FORMAT_ENV, "xml")
    with pytest.raises(ConfigError, match="TXACTORS_LOG_FORMAT='xml' is not a log format"):
        configure_logging()
    monkeypatch.setenv(LOG_FORMAT_ENV, "JSON")
    configure_logging()  # any case


async def test_log_format_json_is_kept_on_a_terminal(tmp_path: Path) -> None:
    """On a TTY logs are for the console, unless --log-format json says otherwise."""
    for flags, expect_json in (((), False), (("--log-format", "json"), True)):
        line = await _first_log_line_on_a_tty(*flags, "server", "--data-dir", str(tmp_path))
        try:
            event = json.loads(line)
        except ValueError:
            assert not expect_json, line
            assert "nats_server_started" in line
        else:
            assert expect_json and event["event"] == "nats_server_started", line


async def _first_log_line_on_a_tty(*args: str) -> str:
    """Run `txactors *args` with stderr on a pseudo-terminal; its first log line, then SIGTERM."""
    controller, terminal = pty.openpty()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "txactors.cli",
        *args,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=terminal,
        env=_env(),
        cwd=ROOT,
    )
    os.close(terminal)
    try:
        seen = b""
        with anyio.fail_after(20):
            while b"nats_server_started" not in seen:
                seen += await anyio.to_thread.run_sync(os.read, controller, 4096)
        return next(line for line in seen.decode().splitlines() if "nats_server_started" in line)
    finally:
        process.send_signal(signal.SIGTERM)
        await process.wait()
        os.close(controller)


async def test_lease_list_exits_as_txn_list_does_where_no_coordinator_ran(
    private_nc: Client,
) -> None:
    """The same situation, the same exit code: nothing to ask (2), not a refusal (1)."""
    url = _url(private_nc)
    (lease, _, lease_err), (txn, _, txn_err) = await asyncio.gather(
        _cli("lease", "list", "--url", url), _cli("txn", "list", "--url", url)
    )
    assert (lease, txn) == (2, 2), lease_err + txn_err
    assert "no coordinator" in lease_err and lease_err.count("\n") == 1, lease_err


async def test_dlq_errors_name_the_dead_letters_server_not_a_coordinator() -> None:
    """`dlq` needs no coordinator, so its errors do not send the operator looking for one;
    `txn`'s still do."""
    unreachable = "nats://127.0.0.1:1"
    (unset, _, unset_err), (down, _, down_err), (txn, _, txn_err) = await asyncio.gather(
        _cli("dlq", "list"),
        _cli("dlq", "list", "--url", unreachable),
        _cli("txn", "list", "--url", unreachable),
    )
    assert unset == 2 and "dead-letter streams" in unset_err, unset_err
    assert down == 2 and "dead-letter streams" in down_err, down_err
    assert "coordinator" not in unset_err + down_err
    assert txn == 2 and "the coordinators (`txactors coordinator`) run on" in txn_err, txn_err


async def test_a_url_whose_port_is_no_number_is_refused_before_connecting() -> None:
    code, out, err = await _cli("txn", "list", "--url", "nats://host:4223x")
    assert (code, out) == (2, ""), err
    assert err.startswith("error: url (NATS_URL)='nats://host:4223x' is not a NATS URL: its port")


async def test_a_bad_number_is_told_in_our_words_not_pydantics() -> None:
    """typer checks `min=`/`max=` and types with pydantic; its "Input should be greater than
    or equal to 1" is said as the coordinator's settings say it."""
    answers = await asyncio.gather(
        _cli("txn", "list", "--limit", "x"),
        _cli("txn", "list", "--limit", "0"),
        _cli("txn", "list", "--limit", "1000000"),
        _cli("dlq", "show", "g", "0"),
    )
    said = []
    for code, out, err in answers:
        assert (code, out) == (2, ""), err
        assert "Input should" not in err and err.count("\n") == 1, err
        said.append(err.split(" (see ")[0])
    assert said == [
        "error: Invalid value for '--limit': expected a whole number, got 'x'",
        "error: Invalid value for '--limit': must be >= 1, got 0",
        "error: Invalid value for '--limit': must be <= 100000, got 1000000",
        "error: Invalid value for 'seq': must be >= 1, got 0",
    ]
