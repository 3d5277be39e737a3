"""Fault points tests can arm, to crash a process exactly where recovery must take over.

`TXACTORS_FAULT=<point>` in a process's environment makes it die (`os._exit`, no cleanup,
like SIGKILL) the first time it reaches that point. Unset, each check is one dict lookup.
"""

from __future__ import annotations

import enum
import os
import sys

FAULT_ENV = "TXACTORS_FAULT"
CRASH_EXIT_CODE = 86


class FaultPoint(enum.StrEnum):
    AFTER_COMMIT_RECORD = "after_commit_record"
    """Coordinator: the commit decision is durable in TXN_OP, nothing is published yet."""
    AFTER_PREPARE = "after_prepare"
    """Producer: halves stored, the local transaction not committed (`TxLog.send_in_transaction`:
    its work done)."""
    AFTER_TXLOG_RECORD = "after_txlog_record"
    """Producer (`TxLog.send_in_transaction`): txid recorded in the open local transaction."""
    AFTER_LOCAL_WORK = "after_local_work"
    """Producer (`TxLog.send_in_transaction`): the work done, the local commit not yet sent."""
    AFTER_LOCAL_COMMIT = "after_local_commit"
    """Producer (`TxLog.send_in_transaction`, a chained handler): the local transaction
    committed, no end sent."""
    AFTER_END = "after_end"
    """Chained handler (`txactors.app.chain`): its transaction ended, the input not acked."""


_armed = os.environ.get(FAULT_ENV)


def crash_if_armed(point: FaultPoint) -> None:
    if _armed == point.value:
        sys.stderr.write(f"txactors: fault point {point.value} reached, crashing\n")
        sys.stderr.flush()
        os._exit(CRASH_EXIT_CODE)
