"""`ungrouped`: what a task group raised comes out as the error itself, so `except` works."""

from __future__ import annotations

import anyio
import pytest

from txactors.errors import PrepareFailed, ungrouped


async def fail_in_a_task(error: BaseException) -> None:
    async def task() -> None:
        raise error

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(task)
        await anyio.sleep_forever()


async def test_one_error_of_a_task_leaves_as_itself_with_its_own_cause_and_context() -> None:
    cause, context = TimeoutError("no answer"), KeyError("before")
    error = PrepareFailed("no coordinator", txid="t1")
    error.__cause__, error.__context__ = cause, context
    with pytest.raises(PrepareFailed) as raised, ungrouped():
        await fail_in_a_task(error)
    assert raised.value is error
    assert (raised.value.__cause__, raised.value.__context__) == (cause, context)


async def test_an_error_of_the_block_and_one_in_nested_groups_leave_as_themselves() -> None:
    with pytest.raises(KeyError), ungrouped():
        async with anyio.create_task_group():
            raise KeyError("the block's own")
    with pytest.raises(ValueError), ungrouped():
        async with anyio.create_task_group() as outer:
            outer.start_soon(fail_in_a_task, ValueError("deep"))
            await anyio.sleep_forever()


def test_several_alike_errors_leave_as_the_first_and_unrelated_ones_stay_a_group() -> None:
    first, second = TimeoutError("read 1"), ConnectionResetError("read 2")
    with pytest.raises(TimeoutError) as raised, ungrouped(TimeoutError, OSError):
        raise ExceptionGroup("reads", [first, second])
    assert raised.value is first
    with pytest.raises(ExceptionGroup), ungrouped(TimeoutError):
        raise ExceptionGroup("unrelated", [first, KeyError("a bug")])
    with pytest.raises(ExceptionGroup), ungrouped():  # nothing said alike: several stay
        raise ExceptionGroup("reads", [first, second])
