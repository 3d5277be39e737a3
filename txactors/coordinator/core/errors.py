"""The one error of the pure core."""

from __future__ import annotations

from txactors.errors import TxActorsError


class CoordinatorStateError(TxActorsError):
    """The actor fed an event that only a bug can produce (an illegal (state, event) pair of
    the transition table, or a protocol error such as replaying outside recovery); nothing
    was changed."""
