"""`txactors run module:app` as a real process: metrics from the start, graceful SIGTERM.

A transaction committed through a real coordinator reaches the worker's handler; SIGTERM
arrives while the handler runs; the handler finishes, its message is acked (not redelivered),
and the process exits 0.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import textwrap
import urllib.request
from pathlib import Path

import anyio
import msgspec
import pytest
from anyio.abc import Process

from tests.support.servers import MakeNatsServer
from tests.support.wait import eventually
from txactors import Decision, TransactionProducer, TxMessage
from txactors.app.worker import load_app
from txactors.coordinator.service import run_coordinator
from txactors.nats.client import connect
from txactors.wire.layout import topic_stream

ROOT = Path(__file__).resolve().parents[2]
WORK_SECONDS = 1.0

APP = textwrap.dedent(
    """
    import os
    from pathlib import Path

    import anyio
    import msgspec

    from txactors import TxApp


    class Job(msgspec.Struct):
        n: int


    LOG = Path(os.environ["WORKER_LOG"])
    app = TxApp("workers")


    @app.consumer("jobs")
    async def work(job: Job) -> None:
        with LOG.open("a") as log:
            log.write(f"start {job.n}\\n")
        await anyio.sleep(float(os.environ["WORK_SECONDS"]))  # the scenario: work that takes long
        with LOG.open("a") as log:
            log.write(f"done {job.n}\\n")
    """
)


class Job(msgspec.Struct):
    n: int


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def scrape(port: int) -> str:
    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            return str(reply.read().decode())

    return await eventually(  # the process may still be importing
        lambda: anyio.to_thread.run_sync(get),
        until=lambda _: True,
        ignoring=(OSError,),
        timeout=20,
        what="the metrics served",
    )


def has_line(path: Path, line: str) -> bool:
    return path.exists() and line in path.read_text().splitlines()


async def wait_for_line(path: Path, line: str) -> None:
    await eventually(lambda: has_line(path, line), timeout=20, what=f"{line!r} in {path.name}")


async def test_run_serves_metrics_and_finishes_in_flight_handlers_on_sigterm(
    make_nats_server: MakeNatsServer, tmp_path: Path
) -> None:
    server = await make_nats_server()
    (tmp_path / "jobs_app.py").write_text(APP)
    log = tmp_path / "worker.log"
    port = free_port()
    env = {
        **os.environ,
        "NATS_URL": server.url,
        "PYTHONPATH": str(ROOT),
        "WORKER_LOG": str(log),
        "WORK_SECONDS": str(WORK_SECONDS),
    }
    command = [sys.executable, "-m", "txactors.cli", "run", "jobs_app:app"]
    nc = await connect(server.url)
    worker: Process | None = None
    stderr_path = tmp_path / "stderr"  # read on failure; a pipe nobody reads can fill
    try:
        async with (
            run_coordinator(nc),
            TransactionProducer(nc, "shop", lambda view: Decision.COMMIT) as producer,
        ):
            with stderr_path.open("wb") as stderr:
                worker = await anyio.open_process(
                    [*command, "--metrics-port", str(port)],
                    cwd=tmp_path,
                    env=env,
                    stdout=None,
                    stderr=stderr,
                )
            text = await scrape(port)
            labels = 'group="workers",topic="jobs"'
            assert f"txactors_consumer_dead_letters_total{{{labels}}} 0.0" in text
            assert f"txactors_consumer_retries_total{{{labels}}} 0.0" in text
            assert f"txactors_consumer_handler_seconds_count{{{labels}}} 0.0" in text
            assert 'txactors_build_info{version="' in text

            async with producer.begin() as txn:
                await txn.send(TxMessage("jobs", msgspec.msgpack.encode(Job(1))))
            await wait_for_line(log, "start 1")
            worker.send_signal(signal.SIGTERM)
            with anyio.fail_after(WORK_SECONDS + 10):
                code = await worker.wait()
            assert code == 0, stderr_path.read_text()
            assert log.read_text().splitlines() == ["start 1", "done 1"]
            assert f"workers: 1 consumer on {server.url};" in stderr_path.read_text()

            info = await nc.jetstream().consumer_info(topic_stream("jobs"), "workers")
            assert (info.num_ack_pending, info.num_pending, info.num_redelivered) == (0, 0, 0)
    finally:
        if worker is not None:
            if worker.returncode is None:
                worker.kill()
            await worker.aclose()
        await nc.close()


def test_load_app_says_what_is_wrong_with_the_target(tmp_path: Path) -> None:
    from txactors.errors import ConfigError

    (tmp_path / "not_an_app.py").write_text("app = 42\n")
    (tmp_path / "broken_app.py").write_text("import no_such_dependency_xyz\n")
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(ConfigError, match=r"not_an_app.app is 42, not a TxApp"):
            load_app("not_an_app")
        with pytest.raises(ConfigError, match=r"cannot import 'no_such_module_xyz'"):
            load_app("no_such_module_xyz:app")
        with pytest.raises(ModuleNotFoundError, match="no_such_dependency_xyz"):
            load_app("broken_app:app")  # the app's own import error keeps its traceback
    finally:
        os.chdir(cwd)
        sys.path.remove(str(tmp_path))


LEAKY_APP = textwrap.dedent(
    """
    import aiosqlite
    import msgspec

    from txactors import TxApp


    class Job(msgspec.Struct):
        n: int


    app = TxApp("workers")
    db = None


    @app.on_startup
    async def open_db() -> None:
        global db
        db = await aiosqlite.connect("jobs.db")  # and no on_shutdown closes it


    @app.consumer("jobs")
    async def work(job: Job) -> None:
        pass
    """
)


@pytest.mark.parametrize("signals", [1, 2])
async def test_a_thread_the_app_left_running_neither_holds_the_worker_nor_makes_it_143(
    make_nats_server: MakeNatsServer, tmp_path: Path, signals: int
) -> None:
    """aiosqlite's connection thread, never closed: Python would wait for it at exit until a
    SIGKILL, and a second SIGTERM found the default handler (143). The worker gives it
    THREAD_GRACE seconds, exits 0 naming it; a second signal meanwhile exits 130."""
    from txactors.app.worker import FORCED_EXIT, THREAD_GRACE

    server = await make_nats_server()
    (tmp_path / "leaky_app.py").write_text(LEAKY_APP)
    env = {**os.environ, "NATS_URL": server.url, "PYTHONPATH": str(ROOT)}
    stderr_path = tmp_path / "stderr"
    with stderr_path.open("wb") as stderr:
        worker = await anyio.open_process(
            [sys.executable, "-m", "txactors.cli", "run", "leaky_app:app"],
            cwd=tmp_path,
            env=env,
            stdout=None,
            stderr=stderr,
        )
    try:
        await eventually(
            lambda: "workers: 1 consumer on" in stderr_path.read_text(),
            timeout=30,
            what="the worker running",
        )
        worker.send_signal(signal.SIGTERM)
        if signals == 2:
            await eventually(
                lambda: "worker_waiting_for_threads" in stderr_path.read_text(),
                timeout=30,
                what="the worker waiting for the app's thread",
            )
            worker.send_signal(signal.SIGTERM)
        with anyio.fail_after(THREAD_GRACE + 20):
            code = await worker.wait()
        said = stderr_path.read_text()
        assert code == (0 if signals == 1 else FORCED_EXIT), said
        if signals == 1:
            assert "worker_exit_past_threads" in said and "_connection_worker_thread" in said
            assert "@app.on_shutdown" in said
    finally:
        if worker.returncode is None:
            worker.kill()
        await worker.aclose()


async def test_the_documented_on_shutdown_example_stops_without_waiting(
    make_nats_server: MakeNatsServer, tmp_path: Path
) -> None:
    """docs/operations.md's worker, which closes in on_shutdown what on_startup opened: exit 0
    at once, no thread left to wait for."""
    import re

    section = (ROOT / "docs" / "operations.md").read_text().split("## Running a worker")[1]
    [example] = re.findall(r"```python\n(# shipping.py.*?)```", section, flags=re.DOTALL)
    server = await make_nats_server()
    (tmp_path / "shipping.py").write_text(example)
    env = {**os.environ, "NATS_URL": server.url, "PYTHONPATH": str(ROOT)}
    stderr_path = tmp_path / "stderr"
    with stderr_path.open("wb") as stderr:
        worker = await anyio.open_process(
            [sys.executable, "-m", "txactors.cli", "run", "shipping:app"],
            cwd=tmp_path,
            env=env,
            stdout=None,
            stderr=stderr,
        )
    try:
        await eventually(
            lambda: "shipping: 1 consumer on" in stderr_path.read_text(),
            timeout=30,
            what="the worker running",
        )
        worker.send_signal(signal.SIGTERM)
        with anyio.fail_after(10):
            code = await worker.wait()
        said = stderr_path.read_text()
        assert code == 0, said
        assert "worker_waiting_for_threads" not in said, said
    finally:
        if worker.returncode is None:
            worker.kill()
        await worker.aclose()
