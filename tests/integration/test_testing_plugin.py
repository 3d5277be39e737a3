"""The `txactors.testing` pytest plugin, used as a user's project uses it: a pytest run of
their test file, in a directory of its own, with nothing but the plugin."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import pytest

import txactors.testing
from tests.support.plugin import PLUGIN, plugin_args
from txactors.testing import ManualClock

ROOT = Path(__file__).resolve().parents[2]

USER_TESTS = textwrap.dedent(
    """
    import pytest

    from txactors import Decision, TxMessage
    from txactors.coordinator import CoordinatorConfig
    from txactors.testing import eventually

    pytestmark = pytest.mark.asyncio


    @pytest.fixture
    def txactors_coordinator_config():
        return CoordinatorConfig(check_max=2)


    async def test_a_commit_reaches_the_consumer_and_a_rollback_never(
        txactors_coordinator, txactors_producer, txactors_consumer
    ):
        handled = []

        async def handler(message):
            handled.append(message.body)

        received = await txactors_consumer("orders", "g", handler)
        producer = await txactors_producer("shop", lambda view: Decision.ROLLBACK)
        with pytest.raises(RuntimeError):
            async with producer.begin() as txn:
                await txn.send(TxMessage("orders", b"rolled back"))
                raise RuntimeError("the local transaction failed")
        async with producer.begin() as txn:
            await txn.send(TxMessage("orders", b"committed"))
        [message] = await received.wait(1)
        assert message.body == b"committed" and handled == [b"committed"]


    async def test_unknown_forever_is_discarded_after_the_configured_check_max(
        txactors_clock, txactors_coordinator, txactors_producer, txactors_nc
    ):
        asked = []

        def checker(view):
            asked.append(view.txid)
            return Decision.UNKNOWN

        producer = await txactors_producer("shop", checker)
        async with producer.begin() as txn:
            await txn.send(TxMessage("orders", b"x"))
            await txn.leave_unknown()
        js = txactors_nc.jetstream()

        async def discarded():
            txactors_clock.advance(60)  # hours of checking, in a few ticks
            return (await js.stream_info("TXN_DISCARD")).state.messages

        await eventually(discarded)
        assert asked == [txn.txid, txn.txid]


    async def test_each_test_gets_a_server_of_its_own(txactors_nats_server, txactors_nc):
        assert await txactors_nc.jetstream().streams_info() == []
    """
)


def test_a_users_tests_pass_with_the_plugins_fixtures(tmp_path: Path) -> None:
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    ini = "[pytest]\nasyncio_default_fixture_loop_scope = function\n"
    (tmp_path / "pytest.ini").write_text(ini)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *plugin_args(), "-p", "no:cacheprovider", "-q"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "3 passed" in result.stdout


def test_the_plugin_is_registered_by_its_entry_point() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"]["pytest11"] == {"txactors": PLUGIN}


def test_every_fixture_of_the_plugin_is_prefixed_so_it_cannot_shadow_a_projects_own() -> None:
    fixtures = [
        name
        for name, value in vars(txactors.testing).items()
        if hasattr(value, "_fixture_function_marker")
    ]
    assert len(fixtures) >= 8
    assert [name for name in fixtures if not name.startswith("txactors_")] == []


def test_the_manual_clock_moves_only_forward_and_only_when_told() -> None:
    clock = ManualClock(100.0)
    assert clock() == clock() == 100.0
    clock.advance(6)
    assert clock() == 106.0
    with pytest.raises(ValueError, match="only moves forward"):
        clock.advance(-1)
    assert abs(ManualClock()() - time.time()) < 60, "starts at the real time"
