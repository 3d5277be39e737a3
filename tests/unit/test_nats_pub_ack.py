"""`pub_ack` reads a JetStream write's answer as nats-py's `PubAck.from_response` does."""

from __future__ import annotations

import json

import msgspec
import pytest
from nats.js.api import PubAck

from txactors.nats.link import pub_ack


@pytest.mark.parametrize(
    "answer",
    [
        b'{"stream":"TXN_HALF","seq":12345}',
        b'{"stream":"TXN_OP","seq":7,"domain":"hub","duplicate":true}',
        b'{"stream":"T","seq":5,"batch":"b1","count":3,"unknown":{"a":1}}',
        b'{"stream":"T","seq":5,"batch_id":"b1","batch_size":3,"val":"7"}',
    ],
)
def test_pub_ack_is_nats_pys(answer: bytes) -> None:
    assert pub_ack(msgspec.json.decode(answer)) == PubAck.from_response(json.loads(answer))
