"""The producer's registry of transactions in flight (producer/inflight.py): held weakly, so a
transaction dropped without an end leaves it at once."""

from __future__ import annotations

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
