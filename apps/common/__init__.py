"""What the two fault demos (apps/transfer, apps/orders) share, so they behave alike.

- `apps.common.options`: the shared flags and defaults (`--concurrency`, `--faults`, `--seed`,
  `--db`, `--data-dir`, `--pg-dsn`, `--pg-prefix`) and `storage_of()`.
- `apps.common.db`: `Storage` (SQLite files or PostgreSQL schemas, one per service) and
  `Database`, one async interface over both: SQL with `?` placeholders in `transaction()`,
  and `apply_once()` for idempotent consumers.
- `apps.common.timing`: `Timing`, the short check-back and redelivery times of a demo run.
- `apps.common.faults`: the fault kinds (`Fault`, `parse_faults`), real child processes to
  SIGKILL (`child_process`, `kill_self`), `LostAck` for duplicates, and `FaultLog`, whose
  tallies count what each fault did in the run.
- `apps.common.fresh`: `start_clean()`, so a rerun on the same NATS data starts empty.
- `apps.common.drain`: `wait_drained()`, until no transaction of the demo is open and every
  consumer group has handled everything; `pipeline_checks()` proves it afterwards.
- `apps.common.report`: `Check` (a fact proven about the books, deliveries or pipeline),
  `Tally` (a count of what happened: outcomes by cause, faults injected; never a mismatch)
  and `Reconciliation` (rendered as rich tables, published as a plain JetStream message),
  `show()`, and the demos' progress bar.
"""
