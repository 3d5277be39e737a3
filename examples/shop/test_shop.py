# test_shop.py
import msgspec
import pytest
from shop import OrderPaid, app

from txactors import Decision, TxMessage


@pytest.mark.asyncio
async def test_a_lost_end_is_committed_by_the_check_back(
    txactors_clock, txactors_coordinator, txactors_producer, txactors_app
):
    shipped = await txactors_app(app)  # runs its consumers, records what they handled
    producer = await txactors_producer("shop", checker=lambda view: Decision.COMMIT)
    async with producer.begin() as txn:
        await txn.send(TxMessage("orders", msgspec.msgpack.encode(OrderPaid(42))))
        await txn.leave_unknown()  # as if the process died before its end
    txactors_clock.advance(6)  # past the transaction timeout: the coordinator asks "shop"
    [message] = await shipped.wait(1)
    assert message.decode(OrderPaid) == OrderPaid(42)
