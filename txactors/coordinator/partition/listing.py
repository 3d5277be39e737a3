"""Which transactions a `ListTransactions` asks for (filters, limit), and how one is shown.

Filtering happens in the coordinator, so an operator looking for the discarded transactions of
one group gets those and not the whole table over the wire. Pure: the coordinator hands in its
table's views (oldest first) and its clock.
"""

from __future__ import annotations

from collections.abc import Iterable

from txactors.coordinator.core.states import TxnState
from txactors.coordinator.core.transactions import TxnView
from txactors.wire.protocol import ListTransactions, TransactionInfo


def select(
    views: Iterable[TxnView], command: ListTransactions, now: float
) -> tuple[list[TxnView], int]:
    """The views matching every filter of `command`, in the order given, at most its `limit`;
    and how many more matched beyond that limit."""
    states = {TxnState(s) for s in command.states}  # the boundary checked them

    def wanted(view: TxnView) -> bool:
        return (
            (not states or view.state in states)
            and (command.group is None or view.group == command.group)
            and (command.topic is None or command.topic in view.topics)
            and (command.older_than is None or now - view.born >= command.older_than)
        )

    matching = [view for view in views if wanted(view)]
    if command.limit is None or len(matching) <= command.limit:
        return matching, 0
    return matching[: command.limit], len(matching) - command.limit


def info(view: TxnView) -> TransactionInfo:
    """What an operator is shown of one transaction."""
    return TransactionInfo(
        txid=view.txid,
        state=view.state.value,
        group=view.group,
        producer=view.producer,
        topics=list(view.topics),
        half_seqs=list(view.half_seqs),
        born=view.born,
        check_times=view.check_times,
        last_check=view.last_check,
        next_check_at=view.next_check_at,
        discard_reason=view.discard_reason.value if view.discard_reason else None,
    )
