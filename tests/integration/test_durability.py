"""Durable by default: every server we start fsyncs before it acks, and one data dir, one server.

What the server really does is read back from its own monitoring endpoint (/varz), not from the
configuration file we wrote: a setting nats-server ignored would pass a file check.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from txactors.cli.settings import BY_NAME, ProcessSettings, load_settings
from txactors.embedded.cluster import EmbeddedNatsCluster
from txactors.embedded.server import (
    CONFIG_FILE_NAME,
    LOCK_FILE_NAME,
    EmbeddedNatsServer,
    FsyncSetting,
)
from txactors.errors import ConfigError, DataDirLocked
from txactors.nats.config import NatsConfig
from txactors.nats.connect import nats_session

if TYPE_CHECKING:
    from tests.support.servers import MakeNatsServer

NANOS = 1_000_000_000


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _monitored() -> tuple[list[str], int]:
    """Extra arguments that open the server's monitoring port, and that port."""
    port = _free_port()
    return ["-m", str(port)], port


async def _jetstream_config(monitor_port: int) -> dict[str, Any]:
    """The JetStream settings the running server reports in /varz."""

    def get() -> dict[str, Any]:
        url = f"http://127.0.0.1:{monitor_port}/varz"
        with urllib.request.urlopen(url, timeout=5) as response:
            varz: dict[str, Any] = json.load(response)
            return varz

    varz = await asyncio.to_thread(get)
    config: dict[str, Any] = varz["jetstream"]["config"]
    return config | {"max_payload": varz["max_payload"]}


# -- what the server runs with ------------------------------------------------------------


async def test_a_server_fsyncs_every_write_by_default(make_nats_server: MakeNatsServer) -> None:
    args, monitor = _monitored()
    server = await make_nats_server(extra_args=args)
    config = await _jetstream_config(monitor)
    assert config.get("sync_always") is True
    assert config["store_dir"] == str((server.data_dir / "jetstream").resolve())


async def test_the_lazy_setting_flushes_on_its_interval(make_nats_server: MakeNatsServer) -> None:
    args, monitor = _monitored()
    await make_nats_server(extra_args=args, fsync="interval", fsync_interval=30)
    config = await _jetstream_config(monitor)
    assert "sync_always" not in config, "a lazy server leaves it out; it never says false"
    assert config["sync_interval"] == 30 * NANOS


async def test_the_lazy_default_is_nats_servers_two_minutes(
    make_nats_server: MakeNatsServer,
) -> None:
    args, monitor = _monitored()
    await make_nats_server(extra_args=args, fsync="interval")
    config = await _jetstream_config(monitor)
    assert "sync_always" not in config
    assert config["sync_interval"] == 120 * NANOS


async def test_a_callers_config_file_is_included_and_stays_durable(
    make_nats_server: MakeNatsServer, tmp_path: Path
) -> None:
    own = tmp_path / "small.conf"
    own.write_text("max_payload: 65536\n")
    args, monitor = _monitored()
    await make_nats_server(extra_args=["-c", str(own), *args])
    config = await _jetstream_config(monitor)
    assert config["max_payload"] == 65536
    assert config.get("sync_always") is True


async def test_the_session_fixture_is_durable(nats_server: EmbeddedNatsServer) -> None:
    assert nats_server.fsync == "always"
    assert "sync_interval: always" in (nats_server.data_dir / CONFIG_FILE_NAME).read_text()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fsync": "sometimes"}, "fsync must be one of always, interval"),
        ({"fsync_interval": 0}, "fsync_interval must be a positive"),
        ({"fsync_interval": float("nan")}, "fsync_interval must be a positive"),
        ({"fsync_interval": float("inf")}, "fsync_interval must be a positive"),
    ],
)
def test_a_bad_fsync_setting_is_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EmbeddedNatsServer(**kwargs)
    with pytest.raises(ConfigError, match=message):
        NatsConfig(**kwargs)


@pytest.mark.parametrize(
    "holder", [NatsConfig, ProcessSettings, EmbeddedNatsServer, EmbeddedNatsCluster]
)
@pytest.mark.parametrize("kwargs", [{"fsync": "sometimes"}, {"fsync_interval": -1.0}])
def test_every_holder_of_the_fsync_setting_refuses_what_the_one_setting_refuses(
    holder: Any, kwargs: dict[str, Any]
) -> None:
    with pytest.raises(ConfigError) as refused:
        FsyncSetting(**kwargs)
    with pytest.raises(ConfigError, match=re.escape(str(refused.value))):
        holder(**kwargs)


def test_the_fsync_setting_has_one_default_and_one_meaning() -> None:
    one = FsyncSetting()
    for holder in (NatsConfig(), ProcessSettings()):
        assert (holder.fsync, holder.fsync_interval) == (one.fsync, one.fsync_interval)
    assert BY_NAME["fsync"].help.startswith("Embedded server only (no NATS_URL): `always`")
    assert BY_NAME["fsync_interval"].help.startswith("Embedded server only: seconds")


# -- the settings reach every server we start ---------------------------------------------


def test_the_environment_chooses_fsync() -> None:
    config = NatsConfig.from_env({"TXACTORS_FSYNC": "interval", "TXACTORS_FSYNC_INTERVAL": "5"})
    assert (config.fsync, config.fsync_interval) == ("interval", 5.0)
    assert NatsConfig.from_env({}).fsync == "always"
    with pytest.raises(ConfigError, match="TXACTORS_FSYNC_INTERVAL='soon' is not a number"):
        NatsConfig.from_env({"TXACTORS_FSYNC_INTERVAL": "soon"})
    with pytest.raises(ConfigError, match=r"fsync must be .*TXACTORS_FSYNC\)"):
        NatsConfig.from_env({"TXACTORS_FSYNC": "never"})


async def test_nats_session_starts_its_server_with_the_configured_fsync(tmp_path: Path) -> None:
    """What the demos and `txactors coordinator` use when there is no NATS_URL."""
    config = NatsConfig(data_dir=str(tmp_path / "lazy"), fsync="interval", fsync_interval=9)
    async with nats_session(config) as session:
        assert session.server is not None
        assert session.server.fsync == "interval"
        written = (session.server.data_dir / CONFIG_FILE_NAME).read_text()
    assert 'sync_interval: "9000ms"' in written
    async with nats_session(NatsConfig(data_dir=str(tmp_path / "durable"))) as session:
        assert session.server is not None
        assert session.server.fsync == "always"


def test_the_coordinator_takes_fsync_from_flag_environment_or_file(tmp_path: Path) -> None:
    file = tmp_path / "coordinator.toml"
    file.write_text('fsync = "interval"\nfsync_interval = 10.0\n')
    from_file = load_settings({}, {}, file).process
    assert (from_file.fsync, from_file.fsync_interval) == ("interval", 10.0)
    from_env = load_settings({}, {"TXACTORS_FSYNC": "always"}, file).process
    assert from_env.fsync == "always"
    assert load_settings({}, {}).process.fsync == "always"
    with pytest.raises(ConfigError, match=r"--fsync: expected one of always, interval"):
        load_settings({"fsync": "sometimes"}, {})
    with pytest.raises(ConfigError, match=r"set by TXACTORS_FSYNC_INTERVAL"):
        load_settings({}, {"TXACTORS_FSYNC_INTERVAL": "0"})


def _cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "TXACTORS_"))}
    return env | extra


async def _run_until_ready(args: list[str], env: dict[str, str], ready: str) -> str:
    """Start `python -m txactors.cli ARGS`, wait for `ready` on stderr, stop it; its stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "txactors.cli",
        *args,
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    lines: list[str] = []
    try:
        async with asyncio.timeout(20):
            while not any(ready in line for line in lines):
                line = (await proc.stderr.readline()).decode()
                assert line, f"exited before {ready!r}: {''.join(lines)}"
                lines.append(line)
    finally:
        proc.send_signal(signal.SIGTERM)
        rest = await asyncio.wait_for(proc.stderr.read(), timeout=10)
        await asyncio.wait_for(proc.wait(), timeout=10)
    return "".join(lines) + rest.decode()


async def test_txactors_server_takes_fsync_flags(tmp_path: Path) -> None:
    data = tmp_path / "cli"
    out = await _run_until_ready(
        ["server", "--data-dir", str(data), "--fsync", "interval", "--fsync-interval", "7"],
        _cli_env(),
        "Ctrl-C to stop",
    )
    assert "fsync every 7s" in out
    assert 'sync_interval: "7000ms"' in (data / CONFIG_FILE_NAME).read_text()


async def test_txactors_server_reads_txactors_fsync(tmp_path: Path) -> None:
    data = tmp_path / "cli"
    out = await _run_until_ready(
        ["server", "--data-dir", str(data)], _cli_env(TXACTORS_FSYNC="interval"), "Ctrl-C"
    )
    assert "fsync every 120s" in out
    assert 'sync_interval: "120000ms"' in (data / CONFIG_FILE_NAME).read_text()


def test_txactors_server_refuses_a_bad_fsync() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "txactors.cli", "server", "--fsync", "sometimes"],
        env=_cli_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "fsync must be one of always, interval" in done.stderr


async def test_txactors_coordinator_runs_its_embedded_server_with_fsync(tmp_path: Path) -> None:
    data = tmp_path / "coordinator"
    env = _cli_env(TXACTORS_DATA_DIR=str(data), TXACTORS_LOG_LEVEL="WARNING")
    await _run_until_ready(["coordinator", "--fsync", "interval"], env, "coordinator ready")
    assert 'sync_interval: "120000ms"' in (data / CONFIG_FILE_NAME).read_text()
    await _run_until_ready(["coordinator"], env, "coordinator ready")
    assert "sync_interval: always" in (data / CONFIG_FILE_NAME).read_text()


# -- one data directory, one server -------------------------------------------------------


async def test_a_second_server_on_the_same_data_dir_fails_at_once(
    make_nats_server: MakeNatsServer, tmp_path: Path
) -> None:
    data = tmp_path / "shared"
    first = await make_nats_server(data_dir=data)
    second = await make_nats_server(data_dir=data, start=False)
    started = time.monotonic()
    with pytest.raises(DataDirLocked, match=rf"{data}.* is in use by another server") as info:
        await second.start()
    assert time.monotonic() - started < 1.0
    assert f"process {os.getpid()}" in str(info.value)
    assert first.running and not second.running
    await first.stop()
    await second.start()  # the directory is free once its server is gone
    assert second.running


async def test_a_killed_server_frees_its_data_dir(make_nats_server: MakeNatsServer) -> None:
    first = await make_nats_server()
    await first.kill()
    second = await make_nats_server(data_dir=first.data_dir)
    assert second.running


def _hold_lock(path: Path, pid_written: int) -> subprocess.Popen[str]:
    """Another process that holds the flock on `path` (having written `pid_written` in it)."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, time\n"
            f"f = open({str(path)!r}, 'a+')\n"
            "fcntl.flock(f, fcntl.LOCK_EX)\n"
            f"f.write('{pid_written}\\n'); f.flush()\n"
            "print('locked', flush=True)\n"
            "time.sleep(60)\n",  # the scenario: hold the lock until killed
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "locked"
    return holder


async def test_a_stale_lock_of_a_dead_process_does_not_block(
    make_nats_server: MakeNatsServer, tmp_path: Path
) -> None:
    data = tmp_path / "stale"
    data.mkdir()
    holder = _hold_lock(data / LOCK_FILE_NAME, pid_written=12345)
    try:
        blocked = await make_nats_server(data_dir=data, start=False)
        with pytest.raises(DataDirLocked, match="process 12345"):
            await blocked.start()
    finally:
        holder.kill()  # dies holding the lock, as a crashed server would
        holder.communicate()
    assert (data / LOCK_FILE_NAME).read_text().strip() == "12345"  # the stale file is still there
    await blocked.start()
    assert blocked.running
