"""Operator actions leave one log line each, `operator_action`: what was asked, how it ended.

An operator resolving transactions by hand (`txactors txn resume|commit|rollback`, one by one
or in bulk) changes what is delivered; the coordinator that carried the action out is the one
place that knows the outcome, so it writes the line when it answers, whatever the answer. A
bulk action's commands carry the same `batch`, so its lines can be found together.
"""

from __future__ import annotations

from typing import Any

from txactors.actors import Request
from txactors.observe.logs import get_logger
from txactors.wire.protocol import Ended, Error, OperatorDecision

log = get_logger(__name__)


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
            "action": command.resolution.value,
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
    """`request`, logged when answered if it is an operator's decision."""
    if isinstance(request.message, OperatorDecision):
        return AuditedRequest(request, partition)
    return request
