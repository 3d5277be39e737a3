# shop.py
import msgspec

from txactors import ConsumedMessage, TxApp


class OrderPaid(msgspec.Struct):
    order_id: int


app = TxApp("shipping")  # the consumer group, unless a handler names another


@app.consumer("orders")
async def ship(order: OrderPaid, message: ConsumedMessage) -> None:
    print("shipping order", order.order_id, "of transaction", message.txid)
