"""How a check-back is decided from the transaction log: look up, else claim a rollback.

The log holds one row per transaction that was decided locally: `committed`, written by the
local transaction itself (so it commits or rolls back with the business change), or
`rolled_back`, written by a check-back that found nothing. Both writes insert under the same
unique key (group, txid), so exactly one of them can ever commit:

- the row is there: the answer is what it says;
- it is not: the check inserts `rolled_back` in its own database transaction and answers
  ROLLBACK only once that commit succeeded. A local transaction still running then fails on
  the key when it records the txid, and rolls back: it can no longer commit;
- the insert fails on the key: the local transaction recorded first (the database made the
  insert wait until it committed), so the row now says `committed`: look it up again.

UNKNOWN only when the database cannot answer now (`LogUnavailable`); the coordinator asks
again later. No I/O here: the backends (one module each) do the reads and writes.
"""

from __future__ import annotations

from typing import Final, Protocol

from txactors.errors import TxActorsError
from txactors.observe.logs import get_logger
from txactors.wire.protocol import Decision

log = get_logger(__name__)

COMMITTED: Final = "committed"
"""The local transaction recorded its txid: it committed with the business change."""
ROLLED_BACK: Final = "rolled_back"
"""A check-back claimed the txid: the local transaction can no longer commit."""


class LogUnavailable(TxActorsError):
    """The database cannot answer now (unreachable, locked, a deadlock victim): the check
    is answered UNKNOWN and asked again later. Raised by a backend, never to the user."""


class DecisionStore(Protocol):
    """The two operations of a check-back, each in its own database transaction."""

    async def lookup(self, txid: str) -> str | None:
        """The recorded decision (`COMMITTED`, `ROLLED_BACK`), None when there is none."""
        ...

    async def claim(self, txid: str) -> bool:
        """Insert `ROLLED_BACK` for `txid` and commit; False when the key was taken."""
        ...


def decision_of(recorded: str) -> Decision:
    if recorded == COMMITTED:
        return Decision.COMMIT
    if recorded == ROLLED_BACK:
        return Decision.ROLLBACK
    raise ValueError(f"the transaction log holds {recorded!r}, not {COMMITTED} or {ROLLED_BACK}")


async def settle(store: DecisionStore, txid: str) -> Decision:
    """The answer to a check-back for `txid`; it never contradicts the local commit."""
    try:
        recorded = await store.lookup(txid)
        if recorded is None:
            if await store.claim(txid):
                return Decision.ROLLBACK
            recorded = await store.lookup(txid)
    except LogUnavailable as error:
        log.warning("txlog_unavailable", txid=txid, error=repr(error.__cause__ or error))
        return Decision.UNKNOWN
    if recorded is None:  # claimed by someone, then pruned in between: ask again
        return Decision.UNKNOWN
    return decision_of(recorded)
