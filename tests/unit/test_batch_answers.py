"""The bounds wire/answers.py counts a batch answer by hold for what the coordinator and the
producer put around them (the rule itself is driven with Hypothesis in
test_coordinator_validation.py)."""

from __future__ import annotations

from txactors.actors.remote import REPLY_HEADROOM
from txactors.coordinator.core.states import Gone, TxnState
from txactors.producer.link import REQUEST_HEADROOM
from txactors.wire.answers import BATCH_ANSWER_BASE, MAX_STATE_LENGTH


def test_every_coordinator_state_fits_the_bound_an_ended_answer_is_counted_with() -> None:
    """`Ended.state` is a coordinator state name; wire counts it at MAX_STATE_LENGTH."""
    too_long = [str(state) for state in [*TxnState, *Gone] if len(state) > MAX_STATE_LENGTH]
    assert too_long == []


def test_a_request_leaves_room_for_the_reply_headroom_and_the_batch_answer() -> None:
    """The producer fits the items' answers in `max_payload - REQUEST_HEADROOM`; the
    coordinator fits them, with the batch answer's own bytes, in `max_payload - REPLY_HEADROOM`.
    So a batch the producer sends is never refused as too large to answer."""
    assert REQUEST_HEADROOM >= REPLY_HEADROOM + BATCH_ANSWER_BASE
