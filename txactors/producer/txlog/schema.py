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
