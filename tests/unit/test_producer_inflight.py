"""The producer's registry of transactions in flight (producer/inflight.py): held weakly, so a
transaction dropped without an end leaves it at once; the last check claims a local commit
the producer makes, until it begins."""

from __future__ import annotations

import pytest

from txactors.errors import RolledBackByCheck
from txactors.producer.inflight import InFlight


class Work:
    """Stands for a transaction object."""


def test_a_dropped_transaction_leaves_at_once_and_one_kept_stays() -> None:
    in_flight = InFlight()
    kept, dropped = Work(), Work()
    in_flight.add("kept", kept)
    in_flight.add("dropped", dropped)
    assert "kept" in in_flight and "dropped" in in_flight and len(in_flight) == 2

    del dropped
    assert "dropped" not in in_flight and "kept" in in_flight
    assert len(in_flight) == 1

    in_flight.discard("kept")
    in_flight.discard("never added")
    assert "kept" not in in_flight and len(in_flight) == 0


def test_an_entry_added_again_is_not_taken_out_by_the_object_it_replaced() -> None:
    in_flight = InFlight()
    first, second = Work(), Work()
    in_flight.add("txid", first)
    in_flight.add("txid", second)
    del first
    assert "txid" in in_flight
    del second
    assert "txid" not in in_flight


def test_a_registry_gone_first_leaves_its_transactions_alone() -> None:
    in_flight = InFlight()
    work = Work()
    in_flight.add("txid", work)
    del in_flight
    del work  # its callback finds no registry: nothing to do, nothing raised


def test_the_last_check_claims_a_local_commit_not_begun_and_the_commit_is_refused() -> None:
    in_flight = InFlight()
    work = Work()
    in_flight.add("txid", work)
    commit = in_flight.local_commit("txid")
    assert in_flight.claim("txid") is True
    assert in_flight.claim("txid") is True  # asked again (a lost answer): still rolled back
    with pytest.raises(RolledBackByCheck):
        commit.begin()


def test_a_local_commit_begun_is_the_logs_to_answer_for() -> None:
    in_flight = InFlight()
    work = Work()
    in_flight.add("txid", work)
    in_flight.local_commit("txid").begin()
    assert in_flight.claim("txid") is False


def test_a_commit_made_by_the_caller_cannot_be_claimed_and_a_finished_one_is_forgotten() -> None:
    in_flight = InFlight()
    work = Work()
    in_flight.add("theirs", work)
    assert in_flight.claim("theirs") is None  # a begin() block: its commit is not ours
    in_flight.add("ours", work)
    in_flight.local_commit("ours")
    in_flight.discard("ours")
    assert in_flight.claim("ours") is None
    in_flight.local_commit("dropped")
    in_flight.add("dropped", Work())  # dropped at once: its commit goes with it
    assert in_flight.claim("dropped") is None
