"""A producer process under load: N workers send a mix of transactions and journal each one.

Usage: python -m tests.peers.load_producer NATS_URLS JOURNAL
           [--workers N] [--partitions P] [--topics t0,t1] [--group G] [--seed S] [--in-order]

It connects to one of NATS_URLS at random, or with `--in-order` to the first one first. It
leaves a server that cannot reach JetStream after TXACTORS_LEAVE_SERVER_AFTER seconds (the
default; 0: never), as a client configured by `NatsConfig` does.

Each worker loops until SIGUSR1: a transaction of one or two messages (random
topics) that ends COMMIT, ROLLBACK, or UNKNOWN; for UNKNOWN the local transaction's outcome
(commit or rollback, at random) is kept in a record the checker answers from, as a database
would be read. A failed prepare rolls back (nothing ran locally) and the worker waits the
error's `retry_after` (or a short pause) before its next transaction, as an application would.

Every transaction is one JSON line in JOURNAL, written when the worker is done with it:
`txid`, `kind` (commit/rollback/unknown), `truth` (what the local transaction decided),
`messages` (the topic of each index), `prepared` (the halves were confirmed), `calls` (each
call's outcome: `ok` with the state, or the exception's class, code and retry_after), `t0`/`t1`
(wall clock around it). Once every worker stopped, a `{"done": ...}` line follows; the process
then keeps answering check-backs until SIGTERM.

"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import time
from pathlib import Path
from typing import Any, TextIO

from txactors.errors import TransactionError
from txactors.nats.client import connect
from txactors.nats.config import NatsConfig
from txactors.producer import CheckView, Decision, TransactionProducer, TxMessage

KINDS = (Decision.COMMIT, Decision.ROLLBACK, Decision.UNKNOWN)
READY_LINE = "LOAD PRODUCER READY"
NO_HINT_PAUSE = 0.2
"""Seconds a worker waits after a failure that came without a retry_after hint."""


class Journal:
    def __init__(self, out: TextIO) -> None:
        self._out = out

    def write(self, line: dict[str, Any]) -> None:
        self._out.write(json.dumps(line) + "\n")
        self._out.flush()


def call_error(call: str, error: BaseException) -> dict[str, Any]:
    return {
        "call": call,
        "error": type(error).__name__,
        "code": getattr(error, "code", None),
        "retry_after": getattr(error, "retry_after", None),
        "message": str(error)[:300],
    }


async def worker(
    producer: TransactionProducer,
    topics: list[str],
    records: dict[str, Decision],
    journal: Journal,
    stop: asyncio.Event,
    rng: random.Random,
) -> None:
    while not stop.is_set():
        kind = rng.choice(KINDS)
        truth = (
            rng.choice((Decision.COMMIT, Decision.ROLLBACK)) if kind is Decision.UNKNOWN else kind
        )
        messages = [rng.choice(topics) for _ in range(rng.randint(1, 2))]
        txn = producer.begin()
        line: dict[str, Any] = {
            "txid": txn.txid,
            "kind": str(kind),
            "truth": str(truth),
            "messages": messages,
            "prepared": False,
            "calls": [],
            "t0": time.time(),
        }
        pause = 0.0
        try:
            try:
                await txn.send(
                    [TxMessage(t, f"{txn.txid}:{i}".encode()) for i, t in enumerate(messages)]
                )
            except TransactionError as error:
                line["calls"].append(call_error("prepare", error))
                line["truth"] = str(Decision.ROLLBACK)  # the local transaction never ran
                await txn.rollback()  # remembered: a check-back of stored halves rolls back
                pause = error.retry_after or NO_HINT_PAUSE
            else:
                line["prepared"] = True
                line["calls"].append({"call": "prepare", "ok": True})
                records[txn.txid] = truth  # the local transaction, committed or not
                result = await txn.end(kind)
                line["calls"].append({"call": "end", "ok": True, "state": result.state})
        except Exception as error:  # journaled: the test decides whether it was allowed
            line["calls"].append(call_error("end" if line["prepared"] else "prepare", error))
            pause = NO_HINT_PAUSE
        line["t1"] = time.time()
        journal.write(line)
        if pause:
            await asyncio.sleep(pause)  # as a client does: the hint's pause, then the next


async def main(args: argparse.Namespace, out: TextIO) -> None:
    records: dict[str, Decision] = {}

    def checker(view: CheckView) -> Decision:
        # No record: the local transaction never ran (its prepare was not confirmed).
        return records.get(view.txid, Decision.ROLLBACK)

    nc = await connect(
        args.urls.split(","),
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.2,
        dont_randomize=args.in_order,
        server_watch=NatsConfig.from_env(url=args.urls).server_watch,
    )
    topics = args.topics.split(",")
    rng = random.Random(args.seed)
    stop_load, stopping = asyncio.Event(), asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, stop_load.set)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
    journal = Journal(out)
    async with TransactionProducer(nc, args.group, checker, partitions=args.partitions) as producer:
        print(READY_LINE, flush=True)
        await asyncio.gather(
            *(
                worker(producer, topics, records, journal, stop_load, random.Random(rng.random()))
                for _ in range(args.workers)
            )
        )
        journal.write({"done": time.time()})
        await stopping.wait()
    await nc.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("urls")
    parser.add_argument("journal")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--partitions", type=int, default=1)
    parser.add_argument("--topics", default="orders")
    parser.add_argument("--group", default="shop")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--in-order", action="store_true")
    arguments = parser.parse_args()
    with Path(arguments.journal).open("a") as journal_file:
        asyncio.run(main(arguments, journal_file))
