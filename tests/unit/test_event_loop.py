"""Which event loop a txactors process runs on (txactors/actors/loop.py)."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from txactors.actors.loop import EVENT_LOOP_ENV, chosen_loop, run, run_anyio
from txactors.errors import ConfigError


async def running_loop_type(_: object = None) -> type:
    return type(asyncio.get_running_loop())


def test_uvloop_is_the_default_and_asyncio_is_chosen_by_name() -> None:
    assert chosen_loop({}) == ("uvloop", uvloop.new_event_loop)
    assert chosen_loop({EVENT_LOOP_ENV: " UVLOOP "}) == ("uvloop", uvloop.new_event_loop)
    assert chosen_loop({EVENT_LOOP_ENV: "asyncio"}) == ("asyncio", None)


@pytest.mark.parametrize("value", ["trio", "uv loop", "asyncio2"])
def test_an_unknown_loop_is_a_config_error_that_names_the_variable(value: str) -> None:
    with pytest.raises(ConfigError, match=EVENT_LOOP_ENV):
        chosen_loop({EVENT_LOOP_ENV: value})


@pytest.mark.parametrize(("asked", "expected"), [(None, uvloop.Loop), ("asyncio", None)])
def test_both_runners_run_on_the_chosen_loop(
    monkeypatch: pytest.MonkeyPatch, asked: str | None, expected: type | None
) -> None:
    if asked is None:
        monkeypatch.delenv(EVENT_LOOP_ENV, raising=False)
    else:
        monkeypatch.setenv(EVENT_LOOP_ENV, asked)
    for loop_type in (run(running_loop_type()), run_anyio(running_loop_type, None)):
        if expected is None:
            assert not issubclass(loop_type, uvloop.Loop)
            assert issubclass(loop_type, asyncio.BaseEventLoop)
        else:
            assert issubclass(loop_type, expected)
