"""`wait_for_stream` logs a missing stream through the one log rate limiter, without a server."""

from __future__ import annotations

from typing import Any, cast

import pytest
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from structlog.testing import capture_logs

from txactors.nats import topics
from txactors.observe import logs


class _LateStream:
    """Stream info that is missing for the first `missing` looks."""

    def __init__(self, missing: int) -> None:
        self.looks = 0
        self._missing = missing

    async def stream_info(self, name: str) -> object:
        self.looks += 1
        if self.looks <= self._missing:
            raise NotFoundError
        return object()


async def _awaited(monkeypatch: pytest.MonkeyPatch, log_every: float) -> list[dict[str, Any]]:
    monkeypatch.setattr(topics, "_WAIT_FIRST", 0.001)
    monkeypatch.setattr(logs, "LOG_EVERY", log_every)
    js = _LateStream(missing=4)
    with capture_logs() as lines:
        assert await topics.wait_for_stream(cast(JetStreamContext, js), "S") == "S"
    assert js.looks == 5
    return [line for line in lines if line["event"] == "stream_awaited"]


async def test_a_missing_stream_is_logged_at_once_then_once_per_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lines = await _awaited(monkeypatch, log_every=3600.0)
    assert [line["stream"] for line in lines] == ["S"]  # 4 looks missed it


async def test_each_look_is_logged_once_the_interval_has_passed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lines = await _awaited(monkeypatch, log_every=0.0)
    assert [line["stream"] for line in lines] == ["S"] * 4
