"""Settings for every test run, unit or integration: quiet logs and Hypothesis's profile.

The server fixtures live in tests/integration/conftest.py: a unit run loads none of them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import settings

from txactors.observe.logs import LOG_LEVEL_ENV, configure_logging


def _configure_test_logging() -> None:
    # Quiet by default; TXACTORS_LOG_LEVEL=DEBUG shows everything.
    configure_logging(os.environ.get(LOG_LEVEL_ENV) or "WARNING")


_configure_test_logging()

# No per-example deadline: the suite runs on loaded 2-core machines, and a slow example is not a
# failed property (speed is measured in bench/, never asserted in tests).
settings.register_profile("txactors", deadline=None)
settings.load_profile("txactors")


@pytest.fixture(autouse=True)
def _reset_logging() -> Iterator[None]:
    """Undo any test's configure_logging (e.g. a CLI run in-process) so levels stay predictable."""
    yield
    _configure_test_logging()
