"""The log table, in SQL every supported database reads the same way.

    txactors_txlog (producer_group, txid, decision, recorded_at), key (producer_group, txid)

`decision` is `committed` or `rolled_back` (see `decide`); `recorded_at` is epoch seconds
(UTC), a plain number so one definition and one retention query serve every database. The
index on (group, time) keeps each group's retention from scanning the table. Names are
limited as the protocol limits them (`layout.NAME_MAX_LENGTH`), so the key fits any index.
"""

from __future__ import annotations

from typing import Final

from txactors.wire.layout import NAME_MAX_LENGTH

TABLE: Final = "txactors_txlog"
INDEX: Final = "txactors_txlog_recorded_at"
GROUP_LENGTH: Final = NAME_MAX_LENGTH["group"]
TXID_LENGTH: Final = NAME_MAX_LENGTH["txid"]
DECISION_LENGTH: Final = 16

CREATE_TABLE: Final = (
    f"CREATE TABLE IF NOT EXISTS {TABLE} ("
    f"producer_group VARCHAR({GROUP_LENGTH}) NOT NULL, "
    f"txid VARCHAR({TXID_LENGTH}) NOT NULL, "
    f"decision VARCHAR({DECISION_LENGTH}) NOT NULL, "
    "recorded_at DOUBLE PRECISION NOT NULL, "
    "PRIMARY KEY (producer_group, txid))"
)
CREATE_INDEX: Final = f"CREATE INDEX IF NOT EXISTS {INDEX} ON {TABLE} (producer_group, recorded_at)"

APPLIED_TABLE: Final = "txactors_applied"
"""Inputs a chained handler applied (`TxLog.mark_applied`): the consumer's apply record,
kept beside the log so that one local transaction holds both (`txactors.app.chain`). A table
of its own, not `apply_once_*`'s `message_apply`, whose PostgreSQL form (a timestamp column)
differs: one portable definition serves every database here."""
MSG_ID_LENGTH: Final = 255

CREATE_APPLIED_TABLE: Final = (
    f"CREATE TABLE IF NOT EXISTS {APPLIED_TABLE} ("
    f"consumer_group VARCHAR({GROUP_LENGTH}) NOT NULL, "
    f"msg_id VARCHAR({MSG_ID_LENGTH}) NOT NULL, "
    "applied_at DOUBLE PRECISION NOT NULL, "
    "PRIMARY KEY (consumer_group, msg_id))"
)
