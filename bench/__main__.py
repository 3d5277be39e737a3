"""`python -m bench [name ...]` (or `just bench`): run the named benchmarks, default all;
`--json DIR` also writes each one's tables to `DIR/<name>.json` (`bench/results.py`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import (
    actors,
    atomic,
    chain,
    cluster,
    consumer,
    cpu,
    fsync,
    idle,
    ingest,
    outbox,
    scale,
    spark,
    transactions,
    transfer,
    wire,
)
from bench.results import record, write
from txactors.actors.loop import run as run_on_loop

BENCHMARKS = {
    "actors": actors.main,
    "fsync": fsync.main,
    "ingest": ingest.main,
    "transactions": transactions.main,
    "scale": scale.main,
    "idle": idle.main,
    "consumer": consumer.main,
    "transfer": transfer.main,
    "spark": spark.main,
    "cpu": cpu.main,
    "wire": wire.main,
    "outbox": outbox.main,
    "atomic": atomic.main,
    "chain": chain.main,
    "cluster": cluster.main,
}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("names", nargs="*", help=f"any of {', '.join(BENCHMARKS)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    parser.add_argument(
        "--json",
        type=Path,
        metavar="DIR",
        help="also write each benchmark's tables to DIR/<name>.json (bench/report.py renders them)",
    )
    args = parser.parse_args()
    unknown = set(args.names) - set(BENCHMARKS)
    if unknown:
        parser.error(
            f"unknown benchmark {', '.join(sorted(unknown))}; choose from {list(BENCHMARKS)}"
        )
    for name in args.names or BENCHMARKS:
        tables = run_on_loop(BENCHMARKS[name](quick=args.quick))
        if args.json is not None:
            print(f"wrote {write(args.json, record(name, tables, quick=args.quick))}")


if __name__ == "__main__":
    main()
