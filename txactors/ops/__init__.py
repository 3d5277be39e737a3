"""The operator's Python API: what `txactors txn`, `dlq`, `lease` and `partitions` do, as
typed async functions a script can call (the commands are built on exactly these).

Connect with `admin_session(url)` (never an embedded server: it would be empty), then pass
the connection to any function here:

- transactions, through the coordinators' admin subjects: `list_transactions`,
  `find_transactions`, `show`, `decide` (`resume`, `commit`, `rollback`), `resolve_all`;
- dead letters, read from the `DLQ_<group>` streams (no coordinator needed):
  `dlq_summaries`, `list_dead_letters`, `show_dead_letter`, `all_sequences`, `replay`;
- leases and partitions, read from the coordinators' buckets: `lease_table`, `list_leases`,
  `partition_count`, `live_coordinators`, `change_partition_count`.

Answers are msgspec Structs (`to_json` prints them as `--json` does); refusals raise
`CommandError` (its `code`, as in docs/protocol.md), and the errors below say what is
missing. docs/operations.md ("The operator API") shows a script; the modules behind the
names (`txn`, `dlq`, `leases`, `partitions`, and the views the commands print with) stay
importable, but these names are the ones kept stable.
"""

from txactors.coordinator.core.states import TxnState
from txactors.errors import CommandError
from txactors.ops.dlq import (
    DeadLetterError,
    DeadLetterInfo,
    DeadLetterPage,
    DlqSummary,
    Replayed,
    all_sequences,
    dlq_summaries,
    list_dead_letters,
    replay,
    show_dead_letter,
)
from txactors.ops.leases import LeaseInfo, LeaseTable, Member, NoLeases, lease_table, list_leases
from txactors.ops.partitions import (
    CoordinatorsRunning,
    change_partition_count,
    live_coordinators,
    partition_count,
)
from txactors.ops.placement import (
    PartitionRow,
    PartitionTable,
    balance_partitions,
    list_partitions,
)
from txactors.ops.txn import (
    ADMIN_TIMEOUT,
    CoordinatorUnavailable,
    Resolution,
    Resolved,
    admin_config,
    admin_session,
    commit,
    decide,
    find_transactions,
    list_transactions,
    new_batch_id,
    resolve_all,
    resume,
    rollback,
    show,
    transaction_filter,
)
from txactors.ops.views import to_json
from txactors.wire.protocol import Ended, ListTransactions, TransactionInfo, TransactionList

__all__ = [
    "ADMIN_TIMEOUT",
    "CommandError",
    "CoordinatorUnavailable",
    "CoordinatorsRunning",
    "DeadLetterError",
    "DeadLetterInfo",
    "DeadLetterPage",
    "DlqSummary",
    "Ended",
    "LeaseInfo",
    "LeaseTable",
    "ListTransactions",
    "Member",
    "NoLeases",
    "PartitionRow",
    "PartitionTable",
    "Replayed",
    "Resolution",
    "Resolved",
    "TransactionInfo",
    "TransactionList",
    "TxnState",
    "admin_config",
    "admin_session",
    "all_sequences",
    "balance_partitions",
    "change_partition_count",
    "commit",
    "decide",
    "dlq_summaries",
    "find_transactions",
    "lease_table",
    "list_dead_letters",
    "list_leases",
    "list_partitions",
    "list_transactions",
    "live_coordinators",
    "new_batch_id",
    "partition_count",
    "replay",
    "resolve_all",
    "resume",
    "rollback",
    "show",
    "show_dead_letter",
    "to_json",
    "transaction_filter",
]
