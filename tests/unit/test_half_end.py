"""The late-halves followers of a process wait on one look at TXN_HALF's end, not one each."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import anyio
import nats.errors
from nats.js import JetStreamContext

from txactors.coordinator.partition.late import HalfEnd

TICK = 0.001


class FakeStream:
    """`stream_info` answering the last sequences given, one per look (an error is raised)."""

    def __init__(self, *answers: int | Exception) -> None:
        self.answers = list(answers)
        self.looks = 0

    async def stream_info(self, name: str) -> Any:
        self.looks += 1
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return SimpleNamespace(state=SimpleNamespace(last_seq=answer))


def half_end(stream: FakeStream) -> HalfEnd:
    return HalfEnd(cast(JetStreamContext, stream), 0, tick=TICK)


async def test_eight_waiting_followers_share_each_look() -> None:
    stream = FakeStream(5, 9)
    end = half_end(stream)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as followers:
            for _ in range(8):
                followers.start_soon(end.grown, 5)
    assert stream.looks == 2, "one look saw no growth, the next saw it: for all eight"
    assert end.last == 9


async def test_a_follower_reads_when_the_stream_cannot_be_looked_at() -> None:
    stream = FakeStream(nats.errors.TimeoutError())
    end = half_end(stream)
    with anyio.fail_after(5):
        await end.grown(5)  # the follower's own read then meets the trouble, and retries
    assert stream.looks == 1
