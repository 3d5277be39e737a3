"""Operator actions leave one log line each, `operator_action`: what was asked, how it ended.

An operator resolving transactions by hand (`txactors txn resume|commit|rollback`, one by one
or in bulk) changes what is delivered; the coordinator that carried the action out is the one
place that knows the outcome, so it writes the line when it answers, whatever the answer. A
bulk action's commands carry the same `batch`, so its lines can be found together.
"""

from __future__ import annotations

from typing import Any, Final

from txactors.actors import Request
from txactors.logs import get_logger
from txactors.protocol import (
    CommitTransaction,
    Ended,
    Error,
    ResumeTransaction,
    RollbackTransaction,
)

log = get_logger(__name__)

ACTIONS: Final[dict[type, str]] = {
    ResumeTransaction: "resume",
    CommitTransaction: "commit",
    RollbackTransaction: "rollback",
}
"""The admin commands that change a transaction, by the name their log line gives them."""


class AuditedRequest(Request):
    """Answers like the request it wraps, and first logs the `operator_action` line."""

    __slots__ = ("_partition",)

    def __init__(self, request: Request, partition: int) -> None:
        super().__init__(request.message, request.reply)
        self._partition = partition

    async def answer(self, value: Any) -> None:
        command = self.message
        fields: dict[str, Any] = {
            "partition": self._partition,
            "txid": command.txid,
            "action": ACTIONS[type(command)],
            "batch": command.batch,
        }
        if isinstance(value, Ended):
            log.info("operator_action", **fields, result=value.state)
        elif isinstance(value, Error):
            log.warning("operator_action", **fields, result=value.code, error=value.message)
        else:
            log.warning("operator_action", **fields, result=type(value).__name__)
        await super().answer(value)


def audited(request: Request, partition: int) -> Request:
    """`request`, logged when answered if it is an operator action (see ACTIONS)."""
    if type(request.message) in ACTIONS:
        return AuditedRequest(request, partition)
    return request
