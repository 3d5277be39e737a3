"""One rule for what passes: a declaration and a coordinator's call retry the same failures."""

from __future__ import annotations

import nats.errors
import nats.js.errors
import pytest

from txactors.nats.retry import Fault, classify, describe, retry_transient
from txactors.nats.topics import declaring

FAILURES: list[BaseException] = [
    TimeoutError(),
    nats.errors.TimeoutError(),
    ConnectionResetError(),
    nats.errors.ConnectionClosedError(),
    nats.errors.NoRespondersError(),
    nats.js.errors.NoStreamResponseError(),
    nats.js.errors.ServiceUnavailableError(code=503, err_code=10008),
    nats.js.errors.ServerError(code=500),
    nats.js.errors.APIError(code=400, err_code=10005),  # no suitable peers (yet)
    nats.js.errors.APIError(code=500, err_code=10119),  # stream offline
    nats.js.errors.APIError(code=409, err_code=10158),  # our own write still in process
    nats.js.errors.NotFoundError(code=404, err_code=10059),
    nats.js.errors.BadRequestError(code=400, err_code=10058),
    nats.errors.MaxPayloadError(),
    nats.js.errors.KeyNotFoundError(),  # an APIError without an err_code
    ValueError("our own bug"),
]


async def outcome(call: str, error: BaseException) -> str:
    """What retrying a call that fails once with `error` ends with."""
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise error
        return "retried"

    try:
        if call == "declaration":
            return await declaring("stream S", flaky, deadline=30.0)
        return await retry_transient(flaky)
    except Exception as raised:
        assert raised is error
        return "raised"


@pytest.mark.parametrize("error", FAILURES, ids=lambda e: f"{type(e).__name__}")
async def test_a_declaration_retries_what_a_coordinator_call_retries(
    error: BaseException,
) -> None:
    assert await outcome("declaration", error) == await outcome("call", error)


async def test_what_passes_is_retried_and_what_stays_is_raised() -> None:
    assert await outcome("call", nats.js.errors.NoStreamResponseError()) == "retried"
    assert await outcome("call", nats.js.errors.NotFoundError(code=404)) == "raised"


def test_a_write_whose_message_id_is_still_in_process_is_tried_again() -> None:
    """409/10158 answers a retry of a write of ours that is still being stored: the next
    attempt is answered as a duplicate, so it passes (never quarantined)."""
    in_process = nats.js.errors.APIError(
        code=409, err_code=10158, description="duplicate message id is in process"
    )
    assert classify(in_process) is Fault.TRANSIENT


def test_an_api_error_raised_without_a_code_is_classified() -> None:
    """nats-py raises KeyNotFoundError without an err_code: it is an answer that stays,
    not an AttributeError in the retry loop."""
    assert classify(nats.js.errors.KeyNotFoundError()) is Fault.PERMANENT


def test_an_api_error_raised_without_a_code_is_described() -> None:
    assert describe(nats.js.errors.KeyNotFoundError()).startswith("KeyNotFoundError None/None")
