"""The tests' wait helper fails a test whose condition never comes, and says what it waited for."""

from __future__ import annotations

import anyio
import pytest

from tests.support.wait import eventually, within


async def test_eventually_returns_the_value_once_the_condition_holds() -> None:
    seen: list[int] = []

    async def grows() -> list[int]:
        seen.append(len(seen))
        return seen

    got = await eventually(grows, until=lambda values: len(values) >= 3, what="three")
    assert got == [0, 1, 2]
    assert await eventually(lambda: "sync", what="a plain value") == "sync"


async def test_eventually_fails_naming_what_it_awaited_and_the_last_value() -> None:
    with pytest.raises(AssertionError) as caught:
        await eventually(lambda: 41, until=lambda n: n == 42, timeout=0.1, what="the answer")
    assert str(caught.value) == "not within 0.1 s: the answer (last seen: 41)"


async def test_without_what_a_lambda_is_named_by_its_source() -> None:
    empty: list[int] = []
    with pytest.raises(AssertionError, match=r"lambda: empty, timeout=0\.05\) \(last seen: \[\]\)"):
        await eventually(lambda: empty, timeout=0.05)


async def test_eventually_adds_the_explanation_on_timeout() -> None:
    with pytest.raises(AssertionError, match=r"never \(last seen: False\)\nthe log tail$"):
        await eventually(lambda: False, timeout=0.05, what="never", explain=lambda: "the log tail")


async def test_ignored_errors_mean_not_yet_and_others_fail_at_once() -> None:
    calls = 0

    def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise ConnectionError("not up yet")
        return "up"

    assert await eventually(flaky, ignoring=(ConnectionError,), what="up") == "up"
    with pytest.raises(AssertionError, match=r"last seen: ConnectionError\('down'\)"):
        await eventually(
            _raises(ConnectionError("down")), ignoring=(ConnectionError,), timeout=0.05
        )
    with pytest.raises(ValueError, match="broken"):
        await eventually(_raises(ValueError("broken")), ignoring=(ConnectionError,), what="x")


async def test_a_probe_that_hangs_is_bounded_by_the_timeout() -> None:
    with pytest.raises(AssertionError, match=r"not within 0\.05 s: an answer"):
        await eventually(anyio.sleep_forever, timeout=0.05, what="an answer")


async def test_within_names_an_event_that_never_came() -> None:
    event = anyio.Event()
    with (
        pytest.raises(AssertionError, match=r"^not within 0\.05 s: the event$"),
        within(0.05, "the event"),
    ):
        await event.wait()
    event.set()
    with within(1, "the event"):
        await event.wait()


def _raises(error: Exception) -> object:
    def probe() -> None:
        raise error

    return probe
