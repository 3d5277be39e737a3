"""`logs.enabled`: what a hot path asks before building a log line."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import structlog

from txactors.observe import logs


@pytest.fixture
def restored() -> Iterator[None]:
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.mark.usefixtures("restored")
def test_follows_the_configured_level() -> None:
    logs.configure_logging("ERROR")
    assert not logs.enabled(logging.INFO)
    assert logs.enabled(logging.ERROR)
    logs.configure_logging("DEBUG")
    assert logs.enabled(logging.DEBUG)


@pytest.mark.usefixtures("restored")
def test_follows_structlog_configured_directly() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    assert not logs.enabled(logging.INFO)
    assert logs.enabled(logging.WARNING)
