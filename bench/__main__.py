"""`python -m bench [name ...]` (or `just bench`): run the named benchmarks, default all."""

from __future__ import annotations

import argparse

from bench import (
    actors,
    atomic,
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
}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("names", nargs="*", help=f"any of {', '.join(BENCHMARKS)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    args = parser.parse_args()
    unknown = set(args.names) - set(BENCHMARKS)
    if unknown:
        parser.error(
            f"unknown benchmark {', '.join(sorted(unknown))}; choose from {list(BENCHMARKS)}"
        )
    for name in args.names or BENCHMARKS:
        run_on_loop(BENCHMARKS[name](quick=args.quick))


if __name__ == "__main__":
    main()
