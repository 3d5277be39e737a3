"""Helpers shared by the demo apps (apps/transfer, apps/orders), kept small on purpose.

- `apps.common.db`: `Storage` (SQLite files or PostgreSQL schemas, one per service) and
  `Database`, one async interface over both: SQL with `?` placeholders in `transaction()`,
  and `apply_once()` for idempotent consumers.
- `apps.common.faults`: the fault kinds a demo can inject (`Fault`, `parse_faults`), real
  child processes to SIGKILL (`child_process`, `kill_self`), and `LostAck` for duplicates.
- `apps.common.drain`: `wait_drained()`, until no transaction is open and every consumer
  group has handled everything.
- `apps.common.report`: `Check` and `Reconciliation` (rendered as a rich table, published as
  a plain JetStream message), and the demos' progress bar.
"""
