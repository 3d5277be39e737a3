"""Real processes to kill: an order-service producer and a logistics consumer.

Killing a task inside the demo's own process would prove little: the connection, the
producer's check responder and the open database transaction would all be cleaned up
politely. A child process that is SIGKILLed leaves exactly what a crashed server leaves:
a half message nobody will end, a database transaction the database must roll back, a
delivery nobody will ack.

The child reports each step on stdout (`PREPARED <txid>`, `HOLDING <txid>`,
`APPLYING <msg_id>`) and then waits; the parent kills it at the step it wants.

    python -m apps.orders.child pay CONFIG ORDER_ID {before-commit|after-commit}
    python -m apps.orders.child consume CONFIG GROUP
"""

from __future__ import annotations

import signal
import sys
from contextlib import AsyncExitStack

import anyio
import msgspec
from nats.aio.client import Client

from apps.common.db import Storage
from apps.common.faults import child_process
from apps.common.timing import Timing
from apps.orders.consumers import GroupHandler, open_chain_log
from apps.orders.events import LOGISTICS, PAID_TAG, PRODUCER_GROUP, TOPIC
from apps.orders.service import OrderService
from txactors.actors.loop import run_anyio
from txactors.consumer import ConsumedMessage, Consumer
from txactors.nats.client import connect
from txactors.observe.logs import configure_logging
from txactors.producer import TransactionProducer

BEFORE_COMMIT = "before-commit"
AFTER_COMMIT = "after-commit"


class ChildConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What a child needs to join the demo: NATS, its database, and the demo's timing."""

    nats_url: str
    storage: list[str]
    """`Storage.to_args()` of the demo's databases."""
    db: str
    """Which of them this child uses."""
    ack_wait: float
    retry_delays: tuple[float, ...]

    @classmethod
    def of(cls, timing: Timing, nats_url: str, storage: Storage, db: str) -> ChildConfig:
        return cls(
            nats_url=nats_url,
            storage=storage.to_args(),
            db=db,
            ack_wait=timing.ack_wait,
            retry_delays=timing.retry_delays,
        )


async def kill_producer_after_prepare(
    config: ChildConfig, order_id: str, stage: str
) -> tuple[str | None, int]:
    """Run a producer child that pays `order_id` up to `stage`, SIGKILL it; returns the txid
    and how the child ended (-SIGKILL)."""
    return await _kill_at(
        ["pay", msgspec.json.encode(config).decode(), order_id, stage], "HOLDING", timeout=30
    )


async def kill_consumer_mid_apply(
    config: ChildConfig, group: str, timeout: float
) -> tuple[str | None, int]:
    """Run a consumer child of `group`; SIGKILL it in the middle of applying its first
    message (returns that msg_id), or after `timeout` if no message came (returns None);
    and how the child ended."""
    return await _kill_at(
        ["consume", msgspec.json.encode(config).decode(), group], "APPLYING", timeout
    )


async def _kill_at(args: list[str], marker: str, timeout: float) -> tuple[str | None, int]:
    """Start the child, wait for its `marker` line (at most `timeout` s), SIGKILL it; the
    rest of that line (None if it never came), and the child's exit code."""
    async with child_process("apps.orders.child", *args) as child:
        try:
            rest: str | None = await child.expect(marker, timeout)
        except TimeoutError:
            rest = None
        child.process.send_signal(signal.SIGKILL)
        return rest, await child.wait()


# -- the child side -------------------------------------------------------------------------


async def pay(config: ChildConfig, order_id: str, stage: str) -> None:
    nc = await connect(config.nats_url)
    db = await Storage.from_args(config.storage).open(config.db)
    service = OrderService(db)
    txlog = await service.open_txlog()
    async with TransactionProducer(nc, PRODUCER_GROUP, txlog.check) as producer:
        service.attach(producer)
        txn, event = await service.prepare_payment(order_id)
        print("PREPARED", txn.txid, flush=True)
        if stage == AFTER_COMMIT:
            await service.record_payment(txn.txid, event)
        print("HOLDING", txn.txid, flush=True)
        await anyio.sleep_forever()


async def consume(config: ChildConfig, group: str) -> None:
    nc = await connect(config.nats_url)
    db = await Storage.from_args(config.storage).open(config.db)

    async def hold(message: ConsumedMessage) -> None:
        print("APPLYING", message.msg_id, flush=True)
        await anyio.sleep_forever()  # inside the open database transaction

    handler = GroupHandler(group, db, mid_apply=hold)
    async with AsyncExitStack() as stack:
        if group == LOGISTICS:  # its handler sends: killed with its shipment.booked prepared
            txlog = await open_chain_log(db)
            producer = TransactionProducer(nc, LOGISTICS, txlog.check)
            handler.chain = (txlog, await stack.enter_async_context(producer))
        await _consume(nc, group, handler, config)


async def _consume(nc: Client, group: str, handler: GroupHandler, config: ChildConfig) -> None:
    async with Consumer(
        nc,
        TOPIC,
        group,
        handler,
        tags=[PAID_TAG],
        concurrency=1,
        ack_wait=config.ack_wait,
        retry_delays=config.retry_delays,
    ):
        print("CONSUMING", group, flush=True)
        await anyio.sleep_forever()


def main(argv: list[str]) -> None:
    configure_logging("ERROR")
    command, raw, *rest = argv
    config = msgspec.json.decode(raw, type=ChildConfig)
    if command == "pay":
        run_anyio(pay, config, rest[0], rest[1])
    elif command == "consume":
        run_anyio(consume, config, rest[0])
    else:
        raise SystemExit(f"unknown command {command!r}; use pay or consume")


if __name__ == "__main__":
    main(sys.argv[1:])
