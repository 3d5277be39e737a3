"""Which partition a new transaction lands in: one partition at a time, each in turn.

A partition's requests travel together only while they are issued together (`link.py`).
Spread at random over P partitions, 64 callers make rounds of 64/P, and every round is a
request, a reply and a group commit of its own: 8 partitions in one coordinator process
committed about half of what one did. Kafka's producer meets the same problem with records
that have no key (KIP-480, the sticky partitioner): it fills one partition's batch before it
moves to the next. A txid means nothing beyond being unique, and the producer chooses it, so
it chooses one in the partition of the moment, which moves on every `block` transactions:
over time each partition gets its share, at any moment a producer's concurrent transactions
share one or two partitions, and producers started apart start on different partitions. A
partition that fails a request is left at once (`avoid`).
"""

from __future__ import annotations

import os
import random
import zlib
from collections.abc import Callable
from typing import Final

_TAIL_DIGITS: Final = 3
_TAILS: Final = tuple(f"{n:0{_TAIL_DIGITS}x}".encode() for n in range(16**_TAIL_DIGITS))
"""The last hex digits a txid may end with, tried in turn until crc32 lands in the partition."""

_HEAD_DIGITS: Final = 32 - _TAIL_DIGITS


def random_txid() -> str:
    """128 random bits in hex: unique without coordination, and a valid subject token."""
    return os.urandom(16).hex()


def txid_in(partition: int, partitions: int, urandom: Callable[[int], bytes] = os.urandom) -> str:
    """A txid of 32 hex digits whose partition (`crc32(txid) mod partitions`, layout.py) is
    `partition`: 116 random bits, then the first of 4,096 three-digit tails that lands there
    (about `partitions` crc32 steps of three bytes; another head in the rare case none does)."""
    if partitions == 1:
        return urandom(16).hex()
    while True:
        head = urandom(16).hex()[:_HEAD_DIGITS]
        crc = zlib.crc32(head.encode())
        for tail in _TAILS:
            if zlib.crc32(tail, crc) % partitions == partition:
                return head + tail.decode()


class StickyPartitions:
    """The partition for the next new transaction: the same one for `block` transactions,
    then the next (pure: the producer's client keeps one per partition count)."""

    __slots__ = ("_block", "_current", "_left", "partitions")

    def __init__(self, partitions: int, block: int, rng: random.Random | None = None) -> None:
        if partitions < 1 or block < 1:
            raise ValueError(f"partitions and block must be >= 1, not {partitions}, {block}")
        self.partitions = partitions
        self._block = block
        self._current = (rng or random.Random()).randrange(partitions)
        self._left = block

    def avoid(self, partition: int) -> None:
        """`partition` failed a request (nobody served it, no answer, a refusal for now):
        if it is the one being filled, the next transactions go to the next one, as Kafka's
        partitioner skips a partition whose leader is slow (KIP-794). Spread at random, a
        partition's outage hits 1/P of the transactions; stuck to it, it would hit them all."""
        if partition == self._current:
            self._left = 0

    def next(self) -> int:
        if self._left == 0:
            self._current = (self._current + 1) % self.partitions
            self._left = self._block
        self._left -= 1
        return self._current
