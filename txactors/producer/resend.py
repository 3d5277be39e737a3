"""When a request with no answer yet is sent again: well before its timeout, never in the
middle of what answers take now.

A request or its reply can be lost with the connection of the coordinator it was on its way
to (a node killed or cut off): nothing comes back, and the caller would wait out its whole
timeout (5 s by default) though the coordinator reconnected within milliseconds. So an
idempotent request goes again (`link.py`, `resend_after`) once it has waited `FACTOR` times
what answers take lately (a moving average, `observe`), at least `FLOOR` seconds and at most
half its timeout: a loaded coordinator that answers slowly answers everyone slowly, so the
average rises with it and nothing is sent twice for being merely slow.
"""

from __future__ import annotations

from typing import Final

FLOOR: Final = 0.25
"""Seconds a request waits at least before it goes again."""
FACTOR: Final = 4.0
"""How many times the usual answer time a request waits before it goes again."""
WEIGHT: Final = 0.1
"""The weight of the newest answer time in the moving average."""
START: Final = 0.05
"""The average assumed before any answer came (a FLOOR's worth of headroom either way)."""


class ResendTimer:
    """The moving average of answer times, and the wait before a request goes again."""

    __slots__ = ("_average",)

    def __init__(self) -> None:
        self._average = START

    def observe(self, seconds: float, waited: float | None = None) -> None:
        """An answer came `seconds` after its request was sent, which went again after
        `waited` if it had none by then: counted as `waited` at most. A request lost and
        answered through its copy says nothing of how long answers take; answers all slower
        than the wait still raise the average, by steps, until it is above them."""
        if waited is not None:
            seconds = min(seconds, waited)
        self._average += WEIGHT * (seconds - self._average)

    def after(self, timeout: float) -> float:
        """Seconds a request with `timeout` waits before it goes again."""
        return min(max(FACTOR * self._average, FLOOR), timeout / 2)
