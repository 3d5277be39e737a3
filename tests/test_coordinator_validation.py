"""What the coordinator refuses before writing anything (pure checks, no server)."""

from __future__ import annotations

import pytest

from txactors.coordinator.validation import HEADER_ALLOWANCE, prepare_problem
from txactors.protocol import OutgoingMessage, Prepare

MAX_PAYLOAD = 1 << 20


def prepare(*messages: OutgoingMessage, txid: str = "t1", group: str = "g") -> Prepare:
    return Prepare(txid=txid, group=group, producer="p1", messages=list(messages))


def problem(request: Prepare) -> str | None:
    return prepare_problem(request, max_payload=MAX_PAYLOAD, max_messages=3)


def test_a_well_formed_prepare_passes() -> None:
    ok = OutgoingMessage(topic="orders", body=b"x", keys=["a"], tag="paid", properties={"X": "1"})
    assert problem(prepare(ok, ok)) is None


@pytest.mark.parametrize(
    ("request_", "hint"),
    [
        (prepare(), "at least one message"),
        (prepare(*[OutgoingMessage(topic="o", body=b"")] * 4), "at most 3"),
        (prepare(OutgoingMessage(topic="o", body=b""), txid="a.b"), "txid"),
        (prepare(OutgoingMessage(topic="o", body=b""), group="g*"), "group"),
        (prepare(OutgoingMessage(topic="my topic", body=b"")), "topic"),
        (prepare(OutgoingMessage(topic="o", body=b"", tag="a>b")), "tag"),
        (prepare(OutgoingMessage(topic="o", body=b"", keys=["a,b"])), "keys"),
        (
            prepare(OutgoingMessage(topic="o", body=b"", properties={"Nats-Msg-Id": "x"})),
            "reserved",
        ),
        (prepare(OutgoingMessage(topic="o", body=b"", properties={"Txn-Id": "x"})), "reserved"),
        (
            prepare(OutgoingMessage(topic="o", body=b"x" * (MAX_PAYLOAD - HEADER_ALLOWANCE + 1))),
            "bytes",
        ),
    ],
)
def test_bad_prepares_are_explained(request_: Prepare, hint: str) -> None:
    explanation = problem(request_)
    assert explanation is not None and hint in explanation
