"""Speaking the coordinator's protocol directly, and reading what reached the topics."""

from __future__ import annotations

from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from tests.support.wait import eventually
from txactors.actors import RemoteActorRef
from txactors.coordinator.partition.recovery import read_subject
from txactors.errors import ActorDeadError, AskTimeout
from txactors.wire import layout
from txactors.wire.protocol import (
    PROTOCOL_VERSION,
    Decision,
    Ended,
    EndTransaction,
    OutgoingMessage,
    Prepare,
    Prepared,
    TransactionInfo,
    TransactionList,
)

FAST = {
    "transaction_timeout": 0.3,
    "check_interval": 0.1,
    "check_interval_max": 0.2,
    "check_answer_timeout": 0.5,
}
"""Short check-back timing for tests that want the checker to act within a second."""


class CoordinatorClient:
    """Raw requests to partition 0: what any language's client would send, as producers
    speak today (the group's subjects, the current protocol version)."""

    def __init__(self, nc: Client, partition: int = 0, group: str = "g") -> None:
        self.nc, self.partition, self.group = nc, partition, group
        self.prepare_ref = self.prepare_for(group)
        self.end_ref = self.end_for(group)
        self.admin_ref = RemoteActorRef(
            nc, layout.admin_subject(partition), TransactionList | TransactionInfo | Ended
        )

    def prepare_for(self, group: str) -> RemoteActorRef:
        return RemoteActorRef(self.nc, layout.prepare_subject(self.partition, group), Prepared)

    def end_for(self, group: str) -> RemoteActorRef:
        return RemoteActorRef(self.nc, layout.end_subject(self.partition, group), Ended)

    async def prepare(
        self,
        txid: str,
        *messages: OutgoingMessage,
        token: str | None = None,
        group: str | None = None,
    ) -> Prepared:
        """A prepare on the subject of `group` (the client's by default)."""
        group = group or self.group
        command = Prepare(
            txid=txid,
            group=group,
            producer="p1",
            messages=list(messages),
            token=token,
            version=PROTOCOL_VERSION,
        )
        result: Prepared = await self.prepare_for(group).ask(command, timeout=5)
        return result

    async def prepare_once_up(self, txid: str, *messages: OutgoingMessage) -> Prepared:
        """Prepare, retrying while a coordinator process is still starting."""
        return await eventually(
            lambda: self.prepare(txid, *messages),
            ignoring=(ActorDeadError, AskTimeout),
            timeout=20,
            interval=0.1,
            what=f"{txid} prepared",
        )

    async def end(
        self,
        txid: str,
        token: str,
        decision: Decision,
        timeout: float = 5,
        group: str | None = None,
    ) -> Ended:
        """An end on the subject of `group` (the client's by default)."""
        result: Ended = await self.end_for(group or self.group).ask(
            EndTransaction(txid=txid, token=token, decision=decision, version=PROTOCOL_VERSION),
            timeout=timeout,
        )
        return result

    async def admin(self, command: Any) -> Any:
        return await self.admin_ref.ask(command, timeout=5)


def message(topic: str = "orders", body: bytes = b"payload", **kwargs: Any) -> OutgoingMessage:
    return OutgoingMessage(topic=topic, body=body, **kwargs)


async def topic_messages(nc: Client, topic: str) -> list[Msg]:
    """Everything on the topic's stream now (empty if the stream does not exist)."""
    js = nc.jetstream()
    try:
        await js.stream_info(layout.topic_stream(topic))
    except Exception:
        return []
    return [
        m async for m in read_subject(js, layout.topic_stream(topic), layout.topic_filter(topic), 1)
    ]


async def topic_ids(nc: Client, topic: str) -> list[str]:
    """The `Nats-Msg-Id`s on a topic, in stream order (duplicates would show twice)."""
    return [(m.headers or {})[layout.MSG_ID_HEADER] for m in await topic_messages(nc, topic)]
