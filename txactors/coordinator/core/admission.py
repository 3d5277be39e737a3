"""Admission: which requests the table refuses before any row changes a transaction.

A refusal is an answer (`Refuse` with a stable code), not a failure: the table stays as it
was. The actor asks `refuse_prepare` before appending halves (so nothing is stored for a
prepare that would be refused), and the table asks again when the halves are stored,
because the transaction may have been decided in between.
"""

from __future__ import annotations

from txactors.coordinator.core import tokens
from txactors.coordinator.core.recent import Outcome
from txactors.coordinator.core.states import OPEN
from txactors.coordinator.core.transactions import Txn
from txactors.wire.protocol import ErrorCode

Refusal = tuple[ErrorCode, str]


def refuse_prepare(
    txn: Txn | None, finished: Outcome | None, txid: str, token: str, group: str, *, begins: bool
) -> Refusal | None:
    """Why halves for `txid` would be refused (None: admissible)."""
    if txn is None:
        if finished is not None:
            return ErrorCode.CONFLICT, f"transaction {txid} is already {finished.state}"
        if not begins:
            return ErrorCode.NOT_FOUND, f"no open transaction {txid} to add messages to"
        return None
    if not tokens.same(txn.token, token):
        return token_refusal(txid, begins=begins)
    if group != txn.group:
        return ErrorCode.CONFLICT, f"transaction {txid} belongs to group {txn.group!r}"
    if txn.state not in OPEN:
        return ErrorCode.CONFLICT, f"transaction {txid} is {txn.state}; it takes no halves"
    return None


def token_refusal(txid: str, *, begins: bool) -> Refusal:
    """A prepare of an existing `txid` without its token: a first prepare (no token)
    is a second transaction under the same id, anything else a wrong token."""
    if begins:
        return ErrorCode.CONFLICT, f"transaction {txid} exists already; its token adds to it"
    return ErrorCode.FORBIDDEN, f"wrong token for transaction {txid}"


def refuse_end(txn: Txn | None, finished: Outcome | None, txid: str, token: str) -> Refusal | None:
    """An `end` is admissible for a known transaction and its own token only."""
    known = txn or finished
    if known is None:
        return ErrorCode.NOT_FOUND, f"no transaction {txid}"
    if not tokens.same(known.token, token):
        return ErrorCode.FORBIDDEN, f"wrong token for transaction {txid}"
    return None
