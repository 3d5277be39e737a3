"""A coordinator's stop cut short: what it cancelled is not printed as tracebacks, what
else goes wrong still is."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from txactors.cli import coordinator


def test_a_cut_stop_hides_only_cancelled_leftovers(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []
    loop = asyncio.new_event_loop()
    try:
        monkeypatch.setattr(loop, "default_exception_handler", seen.append)
        coordinator._quiet_cancelled_leftovers(loop, {"exception": asyncio.CancelledError()})
        assert seen == []
        context = {"message": "boom", "exception": RuntimeError("boom")}
        coordinator._quiet_cancelled_leftovers(loop, context)
        assert seen == [context]
    finally:
        loop.close()
