"""The op fence a read of TXN_OP makes is never past a record it did not read."""

from __future__ import annotations

from txactors.coordinator.partition.recovery import Read


def test_a_read_that_found_nothing_fences_at_the_subjects_last_record() -> None:
    # From a checkpoint at 100: nothing of the subject since 40 (other subjects' seqs).
    assert Read(end=99, last=40).fence == 40


def test_a_read_up_to_the_last_record_fences_there() -> None:
    assert Read(end=120, last=120).fence == 120


def test_a_read_that_stopped_short_fences_at_what_it_read() -> None:
    # The leader names 130, the reads gave up at 120: the first write then finds the fence
    # stale and stops, instead of writing past 121..130 unread.
    assert Read(end=120, last=130).fence == 120
