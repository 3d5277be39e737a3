"""An operator's script on the Python API (`txactors.ops`): who owns which partition, what
the checker gave up on, which consumer groups have dead letters; and, given a group whose
producers are back, resume its discarded transactions.

    NATS_URL=nats://n1:4222 python examples/operator_report.py
    python examples/operator_report.py --url nats://n1:4222 --resume-group shop

Auth comes from the usual variables (NATS_USER, NATS_CREDS, ...), as for `txactors txn`.
docs/operations.md ("The operator API") lists every function; a test runs this script
against a real coordinator (tests/integration/test_operator_api.py).
"""

from __future__ import annotations

import argparse
import asyncio
import time

from txactors import TxActorsError, ops


async def report(url: str | None, resume_group: str | None) -> int:
    """Print the report; the exit code is 1 if a resume was refused, else 0."""
    async with ops.admin_session(url) as nc:
        print(f"partitions: {await ops.partition_count(nc)}")
        leases = await ops.lease_table(nc)
        for lease in leases.leases:
            print(f"  partition {lease.partition}: {lease.owner or 'free'}")

        discarded = await ops.list_transactions(nc, states=[ops.TxnState.DISCARDED])
        print(f"discarded transactions: {len(discarded)}")
        now = time.time()
        for info in discarded:
            print(
                f"  {info.txid} group {info.group}, {now - info.born:.0f}s old, "
                f"{info.check_times} check(s), last: {info.last_check}"
            )

        failed = 0
        if resume_group is not None:
            txids = [info.txid for info in discarded if info.group == resume_group]
            batch = ops.new_batch_id()  # the coordinators log each action with it
            for result in await ops.resolve_all(nc, txids, ops.Resolution.RESUME, batch=batch):
                if result.error is None:
                    print(f"  resumed {result.txid}: {result.state}")
                else:
                    failed += 1
                    print(f"  not resumed {result.txid}: {result.error}")

        summaries = [s for s in await ops.dlq_summaries(nc) if s.entries]
        print(f"consumer groups with dead letters: {len(summaries)}")
        for summary in summaries:
            page = await ops.list_dead_letters(nc, summary.group, limit=1)
            oldest = page.entries[0]
            print(f"  {summary.group}: {summary.entries}, oldest: {oldest.error}")
    return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="the coordinators' NATS server (default: NATS_URL)")
    parser.add_argument("--resume-group", help="resume this producer group's discarded ones")
    args = parser.parse_args()
    try:
        code = asyncio.run(report(args.url, args.resume_group))
    except TxActorsError as exc:  # no server given, unreachable, no coordinator answering
        raise SystemExit(f"error: {exc}") from None
    raise SystemExit(code)


if __name__ == "__main__":
    main()
