"""`txactors coordinator` and both demos as an operator meets them, run as real processes.

A bad flag, variable, file or port is one line on stderr and exit 2; an unreachable NATS is one
line and exit 1; SIGTERM stops the coordinator within seconds whatever its connection is doing;
two coordinators share a process, each with its own metrics.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path

import anyio
import nats
import pytest
from nats.aio.client import Client
from prometheus_client import generate_latest

from tests.support.servers import MakeNatsServer
from tests.support.txn import CoordinatorClient, message
from tests.support.wait import eventually, within
from txactors.coordinator.options import CoordinatorOptions
from txactors.coordinator.service import run_coordinator
from txactors.observe.metrics import CoordinatorMetrics, serve_metrics
from txactors.wire import layout
from txactors.wire.protocol import Decision

ROOT = Path(__file__).resolve().parents[2]
COORDINATOR = ("-m", "txactors.cli", "coordinator")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without txactors or NATS settings, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TXACTORS_", "NATS_"))}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


async def run(*args: str, env: dict[str, str], timeout: float = 30) -> tuple[int, str]:
    """Run `python *args`; its exit code and stderr."""
    with anyio.fail_after(timeout):
        done = await anyio.run_process([sys.executable, *args], env=env, cwd=ROOT, check=False)
    return done.returncode, done.stderr.decode()


def assert_one_line(stderr: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def closed_port() -> int:
    """A port nothing listens on (bound, then freed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


@pytest.mark.parametrize(
    ("args", "env", "config", "named"),
    [
        (["--check-max", "many"], {}, "", "--check-max"),
        (["--bogus"], {}, "", "--bogus"),
        ([], {"TXACTORS_LEASE_TTL": "nan"}, "", "TXACTORS_LEASE_TTL"),
        ([], {"TXACTORS_LOG_LEVEL": "LOUD"}, "", "TXACTORS_LOG_LEVEL"),
        ([], {}, "tick_interval = -0.5\n", "tick_interval"),
        ([], {}, "check_maxx = 3\n", "check_maxx"),
    ],
)
async def test_a_bad_setting_is_one_line_and_exit_2(
    tmp_path: Path, args: list[str], env: dict[str, str], config: str, named: str
) -> None:
    path = tmp_path / "coordinator.toml"
    path.write_text(config)
    code, stderr = await run(*COORDINATOR, "--config", str(path), *args, env=clean_env(**env))
    assert code == 2
    assert named in assert_one_line(stderr)


async def test_a_metrics_port_in_use_is_one_line_and_exit_2() -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, stderr = await run(
            *COORDINATOR, env=clean_env(TXACTORS_METRICS_PORT=str(port), NATS_URL="nats://x:1")
        )
    assert code == 2
    line = assert_one_line(stderr)
    assert str(port) in line and "TXACTORS_METRICS_PORT" in line


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["-m", "apps.transfer", "--transfers", "many"], {}),
        (["-m", "apps.transfer", "--faults", "gremlins"], {}),
        (["-m", "apps.orders", "--orders", "0"], {}),
        (["-m", "apps.orders", "--faults", "gremlins"], {}),
        (["-m", "apps.orders"], {"NATS_URL": "http://not-nats:4222"}),
        (["-m", "apps.transfer"], {"NATS_USER": "alone", "NATS_URL": "nats://x:1"}),
    ],
)
async def test_a_demo_given_bad_input_says_so_in_one_line(
    tmp_path: Path, args: list[str], env: dict[str, str]
) -> None:
    if args[1] == "apps.transfer":
        args = [*args, "--data-dir", str(tmp_path)]
    code, stderr = await run(*args, env=clean_env(**env))
    assert code == 2
    assert_one_line(stderr)


async def test_an_unreachable_nats_is_one_line_and_exit_1(tmp_path: Path) -> None:
    """The coordinator and both demos, at once (each spends seconds on its connect retries)."""
    env = clean_env(NATS_URL=f"nats://127.0.0.1:{closed_port()}")
    commands = [
        COORDINATOR,
        ("-m", "apps.transfer", "--transfers", "1", "--data-dir", str(tmp_path)),
        ("-m", "apps.orders", "--orders", "1"),
    ]
    results: dict[str, tuple[int, str]] = {}

    async def one(command: tuple[str, ...]) -> None:
        results[command[1]] = await run(*command, env=env)

    async with anyio.create_task_group() as tasks:
        for command in commands:
            tasks.start_soon(one, command)
    for name, (code, stderr) in results.items():
        assert code == 1, (name, stderr)
        assert "could not connect to NATS" in assert_one_line(stderr), name


async def start_coordinator(url: str, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        *COORDINATOR,
        *args,
        env=clean_env(NATS_URL=url, TXACTORS_LOG_LEVEL="INFO"),
        cwd=ROOT,
        stderr=asyncio.subprocess.PIPE,
    )


async def read_until(process: asyncio.subprocess.Process, text: bytes) -> bytes:
    """The first line of the process's stderr that holds `text`."""
    assert process.stderr is not None
    with within(20, f"{text!r} from the coordinator"):
        while text not in (line := await process.stderr.readline()):
            assert not process.stderr.at_eof(), f"the coordinator exited before {text!r}"
    return line


async def stopped_within(process: asyncio.subprocess.Process, seconds: float) -> int:
    """SIGTERM, then the exit code; fails if the process takes longer than `seconds`."""
    assert process.stderr is not None
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        with anyio.fail_after(seconds):
            rest = await process.stderr.read()
            code = await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert b"Traceback" not in rest, rest.decode()
    assert time.monotonic() - started < seconds
    return code


@pytest.mark.parametrize("server_state", ["serving", "killed after start", "killed in recovery"])
async def test_sigterm_stops_the_coordinator_within_seconds_whatever_its_connection_does(
    make_nats_server: MakeNatsServer, server_state: str
) -> None:
    server = await make_nats_server()
    coordinator = await start_coordinator(server.url, "--partitions", "8")
    if server_state == "killed in recovery":
        # Partitions are leased then recovered one by one before "ready": kill the server
        # right after the first lease, while the others are still being taken and recovered.
        await read_until(coordinator, b"lease_taken")
        await server.kill()
    else:
        await read_until(coordinator, b"coordinator ready")
        if server_state == "killed after start":
            await server.kill()
            await read_until(coordinator, b"nats_disconnected")  # it noticed: it reconnects now
    assert await stopped_within(coordinator, 3.0) == 0


@pytest.mark.parametrize(("asked", "loop"), [(None, "uvloop"), ("asyncio", "asyncio")])
async def test_the_coordinator_commits_and_stops_on_the_event_loop_it_was_given(
    make_nats_server: MakeNatsServer, asked: str | None, loop: str
) -> None:
    """uvloop by default (txactors/actors/loop.py), asyncio's loop when asked: either one
    serves a transaction to its commit and stops cleanly on SIGTERM."""
    server = await make_nats_server()
    choice = {} if asked is None else {"TXACTORS_EVENT_LOOP": asked}
    coordinator = await asyncio.create_subprocess_exec(
        sys.executable,
        *COORDINATOR,
        env=clean_env(NATS_URL=server.url, **choice),
        cwd=ROOT,
        stderr=asyncio.subprocess.PIPE,
    )
    ready = await read_until(coordinator, b"coordinator ready")
    assert f"(event loop: {loop})".encode() in ready, ready
    nc = await nats.connect(server.url)
    try:
        client = CoordinatorClient(nc)
        receipt = await client.prepare("on-the-loop", message())
        ended = await client.end("on-the-loop", receipt.token, Decision.COMMIT)
    finally:
        await nc.close()
    assert ended.state == "committed"
    assert await stopped_within(coordinator, 3.0) == 0


async def test_two_coordinators_in_one_process_each_have_their_metrics(
    private_nc: Client,
) -> None:
    options = CoordinatorOptions(partitions=2, max_partitions=1)
    first, second = CoordinatorMetrics(), CoordinatorMetrics()
    txids = {layout.partition_of(f"t{n}", 2): f"t{n}" for n in range(20)}
    async with (
        run_coordinator(private_nc, options=options, metrics=first, owner="one") as one,
        run_coordinator(private_nc, options=options, metrics=second, owner="two") as two,
    ):
        owned = [one.partitions, two.partitions]
        assert sorted(owned[0] + owned[1]) == [0, 1]
        for partition, txid in txids.items():
            client = CoordinatorClient(private_nc, partition)
            receipt = await client.prepare(txid, message())
            await client.end(txid, receipt.token, Decision.COMMIT)
        await eventually(  # counted once `done` is written, after the answer
            lambda: all(
                f'txactors_commits_total{{partition="{p}"}} 1.0'
                in generate_latest(m.registry).decode()
                for [p], m in zip(owned, (first, second), strict=True)
            ),
            what="one commit counted on each partition",
        )
        http = [serve_metrics(metrics.registry, 0, addr="127.0.0.1") for metrics in (first, second)]
        try:
            scraped = [
                await anyio.to_thread.run_sync(scrape, server.server_port) for server in http
            ]
        finally:
            for server in http:
                server.shutdown()
                server.server_close()
    for [mine], metrics, text in zip(owned, (first, second), scraped, strict=True):
        other = 1 - mine
        assert f'txactors_commits_total{{partition="{mine}"}} 1.0' in text
        assert f'partition="{other}"' not in text, "each registry holds only its coordinator"
        assert "process_cpu_seconds_total" in text or sys.platform != "linux"
        assert generate_latest(metrics.registry).decode().count("txactors_commits_total{") == 1


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return str(reply.read().decode())


async def test_a_demo_into_a_pipe_keeps_each_row_on_one_line(tmp_path: Path) -> None:
    """`python3 dev.py demo | tee run.log`: the tables as wide as they are, not wrapped at 80."""
    env = {k: v for k, v in clean_env().items() if k != "COLUMNS"}
    env["TXACTORS_DATA_DIR"] = str(tmp_path / "nats")
    args = ("-m", "apps.transfer", "--transfers", "5", "--faults", "none")
    with anyio.fail_after(120):
        done = await anyio.run_process(
            [sys.executable, *args, "--data-dir", str(tmp_path / "db")], env=env, cwd=ROOT,
            check=False,
        )  # fmt: skip
    out = done.stdout.decode()
    assert done.returncode == 0, out + done.stderr.decode()
    # TXACTORS_DATA_DIR is NATS's store, not the databases': the header says where each is.
    assert f"  alipay: {tmp_path / 'db' / 'alipay.db'}" in out.splitlines(), out
    assert f", store {tmp_path / 'nats'} (TXACTORS_DATA_DIR); coordinator" in out, out
    rows = [line for line in out.splitlines() if "alipay: money out = recorded transfers" in line]
    assert len(rows) == 1 and "✓" in rows[0], out
    assert max(map(len, out.splitlines())) > 80
