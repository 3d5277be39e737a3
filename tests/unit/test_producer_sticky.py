"""A new transaction's txid is chosen in the partition the producer fills now (sticky.py):
the txid must still be a unique 32-hex-digit token, land exactly where it was asked to, and
the partitions must take turns so each gets its share."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from txactors.producer.sticky import StickyPartitions, random_txid, txid_in
from txactors.wire.layout import partition_of


@given(st.integers(1, 4096).flatmap(lambda p: st.tuples(st.just(p), st.integers(0, p - 1))))
def test_a_chosen_txid_lands_in_its_partition_and_is_32_hex_digits(case: tuple[int, int]) -> None:
    partitions, partition = case
    txid = txid_in(partition, partitions)
    assert len(txid) == 32 and int(txid, 16) >= 0 and txid == txid.lower()
    assert partition_of(txid, partitions) == partition


def test_chosen_txids_do_not_repeat() -> None:
    txids = [txid_in(3, 8) for _ in range(20_000)]
    assert len(set(txids)) == len(txids)


def test_a_head_no_tail_fits_is_replaced() -> None:
    """With 3,000 partitions some heads have no tail that lands in a given one: another
    random head is drawn (here the first head is forced to be such a one)."""
    partitions = 3000
    target = next(
        p
        for p in range(partitions)
        if all(partition_of("0" * 29 + f"{t:03x}", partitions) != p for t in range(4096))
    )
    heads = iter([bytes(16), bytes(range(16))])
    txid = txid_in(target, partitions, urandom=lambda n: next(heads))
    assert txid.startswith(bytes(range(16)).hex()[:29])
    assert partition_of(txid, partitions) == target


def test_random_txids_are_tokens() -> None:
    txid = random_txid()
    assert len(txid) == 32 and int(txid, 16) >= 0


def test_partitions_take_turns_by_blocks() -> None:
    sticky = StickyPartitions(4, block=3, rng=random.Random(7))
    picks = [sticky.next() for _ in range(24)]
    first = picks[0]
    expected = [(first + n // 3) % 4 for n in range(24)]
    assert picks == expected
    assert Counter(picks) == {p: 6 for p in range(4)}, "each partition its share"


def test_producers_start_on_different_partitions() -> None:
    starts = {StickyPartitions(8, block=256).next() for _ in range(200)}
    assert len(starts) > 1


@pytest.mark.parametrize(("partitions", "block"), [(0, 1), (1, 0)])
def test_nonsense_counts_are_refused(partitions: int, block: int) -> None:
    with pytest.raises(ValueError):
        StickyPartitions(partitions, block)


def test_a_partition_that_failed_is_left_at_once() -> None:
    sticky = StickyPartitions(3, block=100, rng=random.Random(1))
    first = sticky.next()
    sticky.avoid((first + 1) % 3)  # not the one being filled: nothing changes
    assert sticky.next() == first
    sticky.avoid(first)
    moved = [sticky.next() for _ in range(100)]
    assert moved == [(first + 1) % 3] * 100, "a whole block on the next one"
    assert sticky.next() == (first + 2) % 3
