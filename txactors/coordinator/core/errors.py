"""The one error of the pure core."""

from __future__ import annotations

from typing import TYPE_CHECKING

from txactors.errors import TxActorsError

if TYPE_CHECKING:
    from txactors.coordinator.core.events import Event


class CoordinatorStateError(TxActorsError):
    """The actor fed an event that only a bug can produce (an illegal (state, event) pair of
    the transition table, a move to a state its row does not list, or a protocol error such
    as replaying outside recovery); nothing was changed."""

    event: Event | None = None
    """The event refused, set by `handle_batch` (None: a due deadline, or a phase move), so
    that the caller can answer its request and go on with the events after it."""
