"""The coordinator's input boundary, without a server: what it refuses, and that whatever it
accepts fits every limit further down (headers, payload, subjects)."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import math
import re
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from txactors.coordinator.boundary import (
    HEADER_RESERVE,
    MAX_HALF_HEADER_BYTES,
    MAX_KEY_LENGTH,
    MAX_PROPERTY_NAME_LENGTH,
    Boundary,
    answerable_items,
    check_answer_problem,
    ends_of,
    half_header_bytes,
    prepares_of,
)
from txactors.coordinator.core import tokens
from txactors.coordinator.core.states import Gone, TxnState
from txactors.wire import layout
from txactors.wire.answers import MAX_ITEM_ERROR_CHARS, item_error
from txactors.wire.framing import JETSTREAM_MAX_HEADER_BYTES
from txactors.wire.protocol import (
    OLDEST_VERSION,
    PROTOCOL_VERSION,
    CheckResult,
    Codec,
    CommitTransaction,
    CoordinatorCommand,
    Decision,
    Encoding,
    EndBatch,
    Ended,
    EndedBatch,
    EndItem,
    EndTransaction,
    Error,
    ErrorCode,
    ListTransactions,
    OutgoingMessage,
    Prepare,
    PrepareBatch,
    Prepared,
    PreparedBatch,
    PrepareItem,
    ResumeTransaction,
    RollbackTransaction,
    ShowTransaction,
    encode,
)

MAX_PAYLOAD = 1 << 20
MAX_CONTROL_LINE = 4096
BOUNDARY = Boundary(partition=0, partitions=1, max_messages=3, max_immunity=3600.0)
TOKEN = "0123456789abcdef" * 2
NATS_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""What nats-py 2.16 accepts as a header name when it publishes."""


def prepare(*messages: OutgoingMessage, **fields: Any) -> Prepare:
    defaults: dict[str, Any] = {
        "txid": "t1",
        "group": "g",
        "producer": "p1",
        "version": PROTOCOL_VERSION,
    }
    return Prepare(**(defaults | fields), messages=list(messages))


def message(**fields: Any) -> OutgoingMessage:
    return OutgoingMessage(**({"topic": "orders", "body": b"x"} | fields))


def refusal(command: Any, boundary: Boundary = BOUNDARY) -> str | None:
    error = boundary.refusal(command, max_payload=MAX_PAYLOAD)
    if error is None:
        return None
    assert error.code == "bad_request"
    return error.message


def test_a_well_formed_prepare_passes() -> None:
    ok = message(keys=["a", "café"], tag="paid", properties={"X": "1", "Lang": "Grüße", "E": ""})
    assert refusal(prepare(ok, ok)) is None
    assert refusal(prepare(ok, token=TOKEN)) is None


@pytest.mark.parametrize(
    ("request_", "path"),
    [
        (prepare(), "$.messages: 1 to 3"),
        (prepare(*[message()] * 4), "$.messages: 1 to 3"),
        (prepare(message(), txid="a.b"), "$.txid"),
        (prepare(message(), txid="t" * 129), "$.txid"),
        (prepare(message(), group="g*"), "$.group"),
        (prepare(message(), group="g" * 65), "$.group"),
        (prepare(message(), producer="p\n"), "$.producer"),
        (prepare(message(), producer="p" * 129), "$.producer"),
        (prepare(message(), token="F" * 32), "$.token"),
        (prepare(message(), token=""), "$.token"),
        (prepare(message(topic="orders\n")), "$.messages[0].topic"),
        (prepare(message(), message(topic="my topic")), "$.messages[1].topic"),
        (prepare(message(topic="o" * 65)), "$.messages[0].topic"),
        (prepare(message(tag="a>b")), "$.messages[0].tag"),
        (prepare(message(tag="_")), "$.messages[0].tag"),
        (prepare(message(tag="t" * 65)), "$.messages[0].tag"),
        (prepare(message(keys=["a,b"])), "$.messages[0].keys[0]"),
        (prepare(message(keys=["a", ""])), "$.messages[0].keys[1]"),
        (prepare(message(keys=[" a"])), "$.messages[0].keys[0]"),
        (prepare(message(keys=["a\nb"])), "$.messages[0].keys[0]"),
        (prepare(message(keys=["k" * (MAX_KEY_LENGTH + 1)])), "$.messages[0].keys[0]"),
        (prepare(message(properties={"a b": "1"})), "$.messages[0].properties['a b']"),
        (prepare(message(properties={"a:b": "1"})), "$.messages[0].properties['a:b']"),
        (prepare(message(properties={"café": "1"})), "$.messages[0].properties['café']"),
        (prepare(message(properties={"": "1"})), "$.messages[0].properties['']"),
        (prepare(message(properties={"p" * (MAX_PROPERTY_NAME_LENGTH + 1): "1"})), "properties"),
        (prepare(message(properties={"X": "a\r\nNats-Msg-Id: t1:0"})), "properties['X']"),
        (prepare(message(properties={"X": " padded"})), "properties['X']"),
        (prepare(message(properties={"X": "tab\tinside"})), "properties['X']"),
        (prepare(message(properties={"X": "\ud800"})), "properties['X']"),
        (prepare(message(check_immunity=math.nan)), "$.messages[0].check_immunity"),
        (prepare(message(check_immunity=math.inf)), "$.messages[0].check_immunity"),
        (prepare(message(check_immunity=-1.0)), "$.messages[0].check_immunity"),
        (prepare(message(check_immunity=3600.5)), "$.messages[0].check_immunity"),
    ],
)
def test_bad_prepares_are_refused_with_the_path_of_the_field(request_: Prepare, path: str) -> None:
    explanation = refusal(request_)
    assert explanation is not None and path in explanation, explanation


@pytest.mark.parametrize(
    "name",
    [
        "Nats-Msg-Id",
        "nats-msg-id",
        "NATS-EXPECTED-STREAM",
        "Nats-Rollup",
        "Txn-Id",
        "txn-token",
        "TXN-Anything",
        "Status",
        "status",
        "Description",
        "KV-Operation",
    ],
)
def test_a_property_can_never_spell_a_control_header(name: str) -> None:
    explanation = refusal(prepare(message(properties={name: "x"})))
    assert explanation is not None and "reserved" in explanation
    for spelling in (f" {name}", f"{name} ", f"\t{name}"):
        assert refusal(prepare(message(properties={spelling: "x"}))) is not None


def test_headers_count_keys_properties_and_ours_against_the_jetstream_limit() -> None:
    # Properties alone would pass a body-only size check; here they exceed the header limit.
    many = {f"P{i}": "v" * 1000 for i in range(70)}
    explanation = refusal(prepare(message(properties=many)))
    assert explanation is not None and "headers" in explanation
    keys = [f"{i:04d}" + "k" * 200 for i in range(400)]
    assert refusal(prepare(message(keys=keys))) is not None
    # Exactly at the budget passes; one byte more does not.
    base = prepare(message(properties={"Fill": ""}))
    room = MAX_HALF_HEADER_BYTES - half_header_bytes(base, base.messages[0])
    fits = prepare(message(properties={"Fill": "f" * room}))
    assert half_header_bytes(fits, fits.messages[0]) == MAX_HALF_HEADER_BYTES
    assert refusal(fits) is None
    assert refusal(prepare(message(properties={"Fill": "f" * (room + 1)}))) is not None


def test_body_and_headers_together_must_fit_max_payload() -> None:
    base = prepare(message(body=b""))
    headers = half_header_bytes(base, base.messages[0])
    room = MAX_PAYLOAD - HEADER_RESERVE - headers
    assert refusal(prepare(message(body=b"x" * room))) is None
    explanation = refusal(prepare(message(body=b"x" * (room + 1))))
    assert explanation is not None and "max_payload" in explanation


def test_a_txid_is_served_only_by_its_own_partition() -> None:
    partitions = 4
    txid = "order-17"
    owner = layout.partition_of(txid, partitions)
    for partition in range(partitions):
        boundary = Boundary(
            partition=partition, partitions=partitions, max_messages=3, max_immunity=3600.0
        )
        commands: list[Any] = [
            prepare(message(), txid=txid),
            EndTransaction(
                txid=txid, token=TOKEN, decision=Decision.COMMIT, version=PROTOCOL_VERSION
            ),
            ShowTransaction(txid=txid, version=PROTOCOL_VERSION),
            CommitTransaction(txid=txid, version=PROTOCOL_VERSION),
        ]
        for command in commands:
            explanation = refusal(command, boundary)
            if partition == owner:
                assert explanation is None
            else:
                assert explanation is not None and f"partition {owner}" in explanation


def test_ends_and_admin_commands_are_checked_too() -> None:
    assert (
        refusal(
            EndTransaction(
                txid="t1", token=TOKEN, decision=Decision.COMMIT, version=PROTOCOL_VERSION
            )
        )
        is None
    )
    assert "$.token" in (
        refusal(
            EndTransaction(txid="t1", token="x", decision=Decision.COMMIT, version=PROTOCOL_VERSION)
        )
        or ""
    )
    assert "$.txid" in (
        refusal(
            EndTransaction(
                txid="t\n", token=TOKEN, decision=Decision.ROLLBACK, version=PROTOCOL_VERSION
            )
        )
        or ""
    )
    assert "$.txid" in (refusal(ShowTransaction(txid="x" * 1000, version=PROTOCOL_VERSION)) or "")
    assert (
        refusal(ListTransactions(states=["prepared", "discarded"], version=PROTOCOL_VERSION))
        is None
    )
    assert "$.states[1]" in (
        refusal(ListTransactions(states=["prepared", "nope"], version=PROTOCOL_VERSION)) or ""
    )


@pytest.mark.parametrize(
    ("command", "path"),
    [
        (ListTransactions(group="a.b", version=PROTOCOL_VERSION), "$.group"),
        (ListTransactions(topic="x" * 65, version=PROTOCOL_VERSION), "$.topic"),
        (ListTransactions(older_than=-1.0, version=PROTOCOL_VERSION), "$.older_than"),
        (ListTransactions(older_than=math.nan, version=PROTOCOL_VERSION), "$.older_than"),
        (ListTransactions(limit=0, version=PROTOCOL_VERSION), "$.limit"),
        (ListTransactions(limit=100_001, version=PROTOCOL_VERSION), "$.limit"),
        (CommitTransaction(txid="t1", batch="", version=PROTOCOL_VERSION), "$.batch"),
        (ResumeTransaction(txid="t1", batch="b" * 65, version=PROTOCOL_VERSION), "$.batch"),
        (RollbackTransaction(txid="t1", batch="two words", version=PROTOCOL_VERSION), "$.batch"),
    ],
)
def test_admin_filters_and_batch_ids_are_checked(command: Any, path: str) -> None:
    assert path in (refusal(command) or "")


def test_admin_filters_and_batch_ids_within_the_rules_pass() -> None:
    listing = ListTransactions(
        group="g", topic="orders", older_than=0.0, limit=100_000, version=PROTOCOL_VERSION
    )
    assert refusal(listing) is None
    assert (
        refusal(RollbackTransaction(txid="t1", batch="bulk-0a1b2c:x.y", version=PROTOCOL_VERSION))
        is None
    )


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_older_than_is_a_finite_non_negative_number(seconds: float) -> None:
    explanation = refusal(ListTransactions(older_than=seconds, version=PROTOCOL_VERSION))
    assert (explanation is None) == (math.isfinite(seconds) and seconds >= 0), explanation


def test_a_check_answer_must_be_about_the_check_asked() -> None:
    answer = CheckResult(txid="t1", check_id=7, resolution=Decision.COMMIT)
    assert check_answer_problem(answer, txid="t1", check_id=7) is None
    assert "$.txid" in (check_answer_problem(answer, txid="t2", check_id=7) or "")
    assert "$.check_id" in (check_answer_problem(answer, txid="t1", check_id=8) or "")


# -- the codec: bytes that are no request at all -----------------------------------------


@pytest.mark.parametrize("encoding", list(Encoding))
def test_invalid_utf8_and_deep_nesting_are_bad_requests_not_crashes(encoding: Encoding) -> None:
    codec: Codec[Any] = Codec(CoordinatorCommand)
    valid = encode(
        EndTransaction(txid="tx", token=TOKEN, decision=Decision.COMMIT, version=PROTOCOL_VERSION),
        encoding,
    )
    payloads = [
        valid.replace(b"tx", b"\xff\xfe"),
        (b"[" * 100_000 + b"]" * 100_000) if encoding is Encoding.JSON else b"\x91" * 100_000,
        valid[:-1] + b"," + b'"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        if encoding is Encoding.JSON
        else b"\x85" + valid[1:] + b"\xa1x" + b"\x91" * 100_000 + b"\xc0",
        encode(
            {
                "type": "EndTransaction",
                "version": PROTOCOL_VERSION,
                "txid": "t",
                "token": "x" * 100_000,
                "decision": "x" * 100_000,
            },
            encoding,
        ),
    ]
    for payload in payloads:
        decoded = codec.decode(payload, encoding)
        assert isinstance(decoded, Error) and decoded.code == "bad_request", decoded
        assert len(decoded.message) < 1000


# -- tokens ----------------------------------------------------------------------------------


def test_tokens_are_stored_as_digests_and_a_raw_stored_token_matches_nothing() -> None:
    token = tokens.new_tokens(1)[0]
    assert tokens.TOKEN_PATTERN.fullmatch(token)
    stored = tokens.digest(token)
    assert token not in stored and len(stored) == 22  # 128 bits of SHA-256, base64url
    assert tokens.same(stored, tokens.digest(token))
    assert tokens.stored_digest(stored) == stored
    assert not tokens.same(stored, tokens.digest(tokens.new_tokens(1)[0]))
    assert not tokens.same(token, tokens.digest(token)), "raw stored tokens: removed in 0.x"
    assert not tokens.same(tokens.stored_digest(token), tokens.digest(token))


def test_a_digest_stored_before_the_header_diet_still_matches_its_token() -> None:
    token = tokens.new_tokens(1)[0]
    old = "sha256:" + hashlib.sha256(token.encode()).hexdigest()  # how 0.x wrote it before
    assert tokens.same(tokens.stored_digest(old), tokens.digest(token))
    assert not tokens.same(tokens.stored_digest(old), tokens.digest(tokens.new_tokens(1)[0]))


def test_tokens_drawn_together_are_each_a_token_of_their_own() -> None:
    drawn = tokens.new_tokens(64)
    assert len(drawn) == 64 and tokens.new_tokens(0) == []
    assert all(tokens.TOKEN_PATTERN.fullmatch(token) for token in drawn)
    assert len(set(drawn)) == 64  # 128 random bits each: a repeat means a bad slicing
    assert len({token[:8] for token in drawn}) > 1, "not one draw repeated"


def test_a_digest_is_sha256_base64url_without_padding() -> None:
    for token in [tokens.new_tokens(1)[0], *tokens.new_tokens(16)]:
        sha = hashlib.sha256(token.encode()).digest()[:16]
        expected = base64.urlsafe_b64encode(sha).rstrip(b"=").decode()
        assert tokens.digest(token) == expected


# -- Hypothesis: whatever is accepted fits everything downstream, any one bad field is refused

NAME_CHARS = st.sampled_from("abcXYZ019_-")
WORD = st.text(st.characters(codec="utf-8", exclude_categories=("C", "Z")), min_size=1, max_size=12)
HEADER_TEXT = st.lists(WORD, max_size=3).map(" ".join)
"""Printable UTF-8 (non-ASCII included), blanks only between words: a valid value."""
PROPERTY_NAMES = st.text(st.sampled_from("abAB09-_.!~'|"), min_size=1, max_size=12).filter(
    lambda n: not layout.is_reserved_header(n)
)


def valid_names(kind: str) -> st.SearchStrategy[str]:
    limit = layout.NAME_MAX_LENGTH[kind]
    return st.one_of(st.text(NAME_CHARS, min_size=1, max_size=8), st.just("n" * limit))


def bad_names(kind: str) -> st.SearchStrategy[str]:
    limit = layout.NAME_MAX_LENGTH[kind]
    return st.one_of(
        st.just(""),
        st.integers(limit + 1, limit * 20).map(lambda n: "n" * n),
        st.tuples(
            st.text(NAME_CHARS, max_size=4),
            st.sampled_from(list(" .*>\n\t\r:é\x00/")),
            st.text(NAME_CHARS, max_size=4),
        ).map("".join),
    )


BAD_TEXT = st.one_of(
    HEADER_TEXT.map(lambda t: f" {t}"),
    HEADER_TEXT.map(lambda t: f"{t}\t"),
    st.tuples(
        HEADER_TEXT,
        st.sampled_from(["\r\n", "\n", "\r", "\x00", "\x7f", "\u2028", "\ud800"]),
        HEADER_TEXT,
    ).map("".join),
)
BAD_PROPERTY_NAMES = st.one_of(
    st.sampled_from(
        [
            "Nats-Msg-Id",
            "nats-msg-id",
            " Txn-Id",
            "Txn-Id ",
            "STATUS",
            "a b",
            "a:b",
            "é",
            "",
            "p" * 129,
        ]
    ),
    st.text(max_size=4).filter(lambda n: not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", n)),
)


@st.composite
def valid_messages(draw: st.DrawFn) -> OutgoingMessage:
    return OutgoingMessage(
        topic=draw(valid_names("topic")),
        body=draw(
            st.one_of(st.binary(max_size=64), st.integers(0, MAX_PAYLOAD).map(lambda n: b"b" * n))
        ),
        keys=draw(
            st.lists(
                HEADER_TEXT.filter(lambda k: k and "," not in k and len(k) <= MAX_KEY_LENGTH),
                max_size=4,
            )
        ),
        tag=draw(st.none() | valid_names("tag").filter(lambda t: t != layout.NO_TAG)),
        properties=draw(st.dictionaries(PROPERTY_NAMES, HEADER_TEXT, max_size=5)),
        check_immunity=draw(st.none() | st.floats(0, 3600)),
    )


@st.composite
def valid_prepares(draw: st.DrawFn) -> Prepare:
    return Prepare(
        txid=draw(valid_names("txid")),
        group=draw(valid_names("group")),
        producer=draw(valid_names("producer")),
        messages=draw(st.lists(valid_messages(), min_size=1, max_size=3)),
        token=draw(st.none() | st.just(TOKEN)),
        version=PROTOCOL_VERSION,
    )


@st.composite
def one_bad_field(draw: st.DrawFn) -> tuple[Prepare, str]:
    """A prepare that would be fine but for one field; returns it with that field's path."""
    base = draw(valid_prepares())
    first = base.messages[0]
    rest = base.messages[1:]
    field = draw(
        st.sampled_from(
            [
                "txid",
                "group",
                "producer",
                "token",
                "messages",
                "topic",
                "tag",
                "key",
                "property name",
                "property value",
                "check_immunity",
            ]
        )
    )
    if field in ("txid", "group", "producer"):
        return msgspec.structs.replace(base, **{field: draw(bad_names(field))}), f"$.{field}"
    if field == "token":
        token = draw(st.text(max_size=40).filter(lambda t: not tokens.TOKEN_PATTERN.fullmatch(t)))
        return msgspec.structs.replace(base, token=token), "$.token"
    if field == "messages":
        return msgspec.structs.replace(
            base, messages=draw(st.sampled_from([[], [first] * 4]))
        ), "$.messages"
    if field in ("topic", "tag"):
        bad = draw(bad_names(field) | st.just("_")) if field == "tag" else draw(bad_names(field))
        changed = msgspec.structs.replace(first, **{field: bad})
    elif field == "key":
        bad = draw(BAD_TEXT | st.just("") | st.just("a,b") | st.just("k" * (MAX_KEY_LENGTH + 1)))
        changed = msgspec.structs.replace(first, keys=[*first.keys, bad])
        return msgspec.structs.replace(
            base, messages=[changed, *rest]
        ), f"$.messages[0].keys[{len(first.keys)}]"
    elif field == "property name":
        changed = msgspec.structs.replace(
            first, properties={**first.properties, draw(BAD_PROPERTY_NAMES): "v"}
        )
        return msgspec.structs.replace(base, messages=[changed, *rest]), "$.messages[0].properties["
    elif field == "property value":
        changed = msgspec.structs.replace(
            first, properties={**first.properties, "Bad": draw(BAD_TEXT)}
        )
        return msgspec.structs.replace(
            base, messages=[changed, *rest]
        ), "$.messages[0].properties['Bad']"
    else:
        bad_immunity = draw(
            st.sampled_from([math.nan, math.inf, -math.inf, -0.001, 3600.001, 1e300])
        )
        changed = msgspec.structs.replace(first, check_immunity=bad_immunity)
    return msgspec.structs.replace(base, messages=[changed, *rest]), f"$.messages[0].{field}"


def nats_header_value_survives(value: str) -> bool:
    """nats-py trims values and turns line breaks into spaces when it publishes."""
    return value == value.strip() and "\r" not in value and "\n" not in value


@settings(max_examples=300, deadline=None)
@given(st.one_of(valid_prepares(), one_bad_field().map(lambda pair: pair[0])))
def test_every_accepted_prepare_fits_headers_payload_and_subjects(request_: Prepare) -> None:
    if refusal(request_) is not None:
        return
    subjects = [
        layout.prepare_subject(0, request_.group),
        layout.check_instance_subject(request_.group, request_.producer),
        layout.discard_subject(request_.group),
    ]
    for m in request_.messages:
        subjects += [
            layout.topic_subject(m.topic, m.tag),
            layout.dlq_subject(request_.group, m.topic),
        ]
        headers = half_header_bytes(request_, m)
        assert headers <= JETSTREAM_MAX_HEADER_BYTES - HEADER_RESERVE
        assert headers + len(m.body) <= MAX_PAYLOAD - HEADER_RESERVE
        for name, value in m.properties.items():
            assert NATS_HEADER_NAME.fullmatch(name) and not layout.is_reserved_header(name)
            assert nats_header_value_survives(value)
            value.encode()  # strict UTF-8: no lone surrogates
        for key in m.keys:
            assert key and "," not in key and nats_header_value_survives(key)
        assert m.check_immunity is None or 0 <= m.check_immunity <= 3600
    for subject in subjects:
        assert all(re.fullmatch(r"[A-Za-z0-9_-]+", t) for t in subject.split(".")), subject
        assert len(subject.encode()) < MAX_CONTROL_LINE // 8, "well under the control line"


@settings(max_examples=300, deadline=None)
@given(one_bad_field())
def test_any_one_bad_field_is_refused_with_its_path(case: tuple[Prepare, str]) -> None:
    request_, path = case
    explanation = refusal(request_)
    assert explanation is not None and explanation.startswith(path), (explanation, path)


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(["txid", "group", "producer", "topic", "tag"]),
    extra=st.integers(-3, 3),
)
def test_a_name_is_accepted_exactly_up_to_its_limit(kind: str, extra: int) -> None:
    length = max(layout.NAME_MAX_LENGTH[kind] + extra, 1)
    name = "n" * length
    if kind in ("topic", "tag"):
        command = prepare(message(**{kind: name}))
    else:
        command = prepare(message(), **{kind: name})
    explanation = refusal(command)
    if length <= layout.NAME_MAX_LENGTH[kind]:
        assert explanation is None
    else:
        assert explanation is not None and kind in explanation


@settings(max_examples=200, deadline=None)
@given(
    key_length=st.integers(MAX_KEY_LENGTH - 2, MAX_KEY_LENGTH + 2),
    name_length=st.integers(MAX_PROPERTY_NAME_LENGTH - 2, MAX_PROPERTY_NAME_LENGTH + 2),
)
def test_keys_and_property_names_are_accepted_exactly_up_to_their_limits(
    key_length: int, name_length: int
) -> None:
    assert (refusal(prepare(message(keys=["k" * key_length]))) is None) == (
        key_length <= MAX_KEY_LENGTH
    )
    assert (refusal(prepare(message(properties={"p" * name_length: "v"}))) is None) == (
        name_length <= MAX_PROPERTY_NAME_LENGTH
    )


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.sampled_from(list(Encoding)))
def test_any_bytes_decode_to_a_command_or_an_error(data: bytes, encoding: Encoding) -> None:
    codec: Codec[Any] = Codec(CoordinatorCommand)
    decoded = codec.decode(data, encoding)
    assert isinstance(decoded, Prepare | EndTransaction | Error)
    if isinstance(decoded, Error):
        assert decoded.code in ("bad_request", "unknown_command")
    else:
        refusal(decoded)  # whatever decoded, the boundary judges it without raising


def test_json_refuses_what_json_cannot_say() -> None:
    lone_surrogate = (
        b'{"type":"EndTransaction","version":2,"txid":"\\ud800","token":"x","decision":"commit"}'
    )
    huge_number = (
        b'{"type":"Prepare","version":2,"txid":"t","group":"g","producer":"p",'
        b'"messages":[{"topic":"o","body":"","check_immunity":1e999}]}'
    )
    for payload in (lone_surrogate, huge_number):
        decoded = Codec(CoordinatorCommand).decode(payload, Encoding.JSON)
        assert isinstance(decoded, Error) and decoded.code == "bad_request", decoded


COMMANDS = [
    prepare(message()),
    EndTransaction(txid="t1", token=TOKEN, decision=Decision.COMMIT, version=PROTOCOL_VERSION),
    ListTransactions(version=PROTOCOL_VERSION),
    ShowTransaction(txid="t1", version=PROTOCOL_VERSION),
    ResumeTransaction(txid="t1", version=PROTOCOL_VERSION),
    CommitTransaction(txid="t1", version=PROTOCOL_VERSION),
    RollbackTransaction(txid="t1", version=PROTOCOL_VERSION),
]


@given(command=st.sampled_from(COMMANDS), version=st.integers(-(2**63), 2**64 - 1))
def test_the_version_is_checked_first_on_every_command(command: Any, version: int) -> None:
    refusal = BOUNDARY.refusal(
        msgspec.structs.replace(command, version=version), max_payload=MAX_PAYLOAD
    )
    if OLDEST_VERSION <= version <= PROTOCOL_VERSION:
        assert refusal is None
    elif version > PROTOCOL_VERSION or version >= 1:  # newer, or removed in 0.x (1)
        assert refusal is not None and refusal.code == ErrorCode.UNSUPPORTED_VERSION
    else:
        assert refusal is not None and refusal.code == ErrorCode.BAD_REQUEST
        assert refusal.message.startswith("$.version:")
    if hasattr(command, "txid"):
        newer = msgspec.structs.replace(command, version=PROTOCOL_VERSION + 1, txid="not ok")
        refused = BOUNDARY.refusal(newer, max_payload=MAX_PAYLOAD)
        assert refused is not None and refused.code == ErrorCode.UNSUPPORTED_VERSION


def test_a_newer_version_is_recognised_even_when_the_command_does_not_decode() -> None:
    codec: Codec[Any] = Codec(CoordinatorCommand)
    future = {"type": "Prepare", "version": PROTOCOL_VERSION + 1, "txid": "t1", "parts": [1]}
    for encoding in Encoding:
        payload = msgspec.json.encode(future) if encoding is Encoding.JSON else encode(future)
        answer = codec.decode(payload, encoding)
        assert isinstance(answer, Error) and answer.code == ErrorCode.UNSUPPORTED_VERSION
    assert Codec(CheckResult).versioned is False, "only coordinator commands carry a version"
    unknown = Codec(CheckResult).decode(encode({"type": "CheckResult", "version": 9}))
    assert isinstance(unknown, Error) and unknown.code == ErrorCode.BAD_REQUEST


@pytest.mark.parametrize("encoding", list(Encoding))
def test_a_version_1_command_is_refused_with_unsupported_version(encoding: Encoding) -> None:
    """Removed in 0.x: a known command without `version` (the codec) or with 1 (the
    boundary) is told what to send; a payload that is not one of our commands keeps its own
    error."""
    codec: Codec[Any] = Codec(CoordinatorCommand)
    end = {"type": "EndTransaction", "txid": "t1", "token": TOKEN, "decision": "commit"}
    cases = [
        (end, ErrorCode.UNSUPPORTED_VERSION),
        ({**end, "version": 1}, ErrorCode.UNSUPPORTED_VERSION),
        ({"type": "Prepare", "txid": 5}, ErrorCode.UNSUPPORTED_VERSION),
        ({"type": "Explode"}, ErrorCode.UNKNOWN_COMMAND),
        ({}, ErrorCode.BAD_REQUEST),
    ]
    for command, code in cases:
        decoded = codec.decode(encode(command, encoding), encoding)
        answer = (
            decoded
            if isinstance(decoded, Error)
            else BOUNDARY.refusal(decoded, max_payload=MAX_PAYLOAD)
        )
        assert answer is not None and answer.code == code, (command, answer)
        if code is ErrorCode.UNSUPPORTED_VERSION:
            assert f"send version {PROTOCOL_VERSION}" in answer.message
    current = codec.decode(encode({**end, "version": PROTOCOL_VERSION}, encoding), encoding)
    assert isinstance(current, EndTransaction)


# -- batches ----------------------------------------------------------------------------------


def prepare_batch(*items: PrepareItem, **fields: Any) -> PrepareBatch:
    defaults: dict[str, Any] = {"group": "g", "producer": "p1", "version": PROTOCOL_VERSION}
    return PrepareBatch(**(defaults | fields), items=list(items))


def end_batch(*txids: str, version: int = PROTOCOL_VERSION) -> EndBatch:
    items = [EndItem(txid=t, token=TOKEN, decision=Decision.COMMIT) for t in txids]
    return EndBatch(version=version, items=items)


def test_a_batch_is_checked_whole_before_its_items() -> None:
    ok = PrepareItem(txid="t1", messages=[message()])
    boundary = dataclasses.replace(BOUNDARY, max_batch_items=3)
    cases: list[tuple[Any, str, str]] = [
        (prepare_batch(ok, version=OLDEST_VERSION), "bad_request", "$.version: 3 or later"),
        (end_batch("t1", version=OLDEST_VERSION), "bad_request", "$.version: 3 or later"),
        (prepare_batch(ok, group="a b"), "bad_request", "$.group:"),
        (prepare_batch(ok, producer=""), "bad_request", "$.producer:"),
        (prepare_batch(), "bad_request", "$.items: 1 to 3 items"),
        (prepare_batch(ok, ok, ok, ok), "bad_request", "$.items: 1 to 3 items"),
        (end_batch("t1", "t2", "t3", "t4"), "bad_request", "$.items: 1 to 3 items"),
        (prepare_batch(ok, version=PROTOCOL_VERSION + 1), "unsupported_version", ""),
    ]
    for command, code, start in cases:
        error = boundary.refusal(command, max_payload=MAX_PAYLOAD)
        assert error is not None and error.code == code, (command, error)
        assert error.message.startswith(start), error.message
    other = boundary.refusal(
        prepare_batch(ok, group="h"), max_payload=MAX_PAYLOAD, subject="txn.coord.0.prepare.g"
    )
    assert other is not None and other.code == "forbidden"
    bad_items = prepare_batch(PrepareItem(txid="a b", messages=[]), ok, ok)
    assert boundary.refusal(bad_items, max_payload=MAX_PAYLOAD) is None, "items: one by one"
    assert boundary.refusal(end_batch("a b", "t1"), max_payload=MAX_PAYLOAD) is None


def test_each_item_is_the_lone_command_it_stands_for() -> None:
    batch = prepare_batch(
        PrepareItem(txid="t1", messages=[message()]),
        PrepareItem(txid="a b", messages=[message()], token=TOKEN),
        PrepareItem(txid="t2", messages=[]),
    )
    lone = prepares_of(batch)
    assert lone[1] == prepare(message(), txid="a b", token=TOKEN)
    assert [refusal(p) for p in lone] == [
        None,
        refusal(prepare(message(), txid="a b")),
        "$.messages: 1 to 3 messages per prepare",
    ]
    ends = ends_of(end_batch("t1", "a b"))
    assert ends[0] == EndTransaction(
        txid="t1", token=TOKEN, decision=Decision.COMMIT, version=PROTOCOL_VERSION
    )
    assert refusal(ends[1]) is not None


@pytest.mark.parametrize("encoding", list(Encoding))
def test_an_item_of_the_wrong_type_is_refused_alone(encoding: Encoding) -> None:
    """An item whose field has the wrong type (`"txid": 5`), or that is no map, does not fail
    the batch's decoding: it is refused with the error it gets alone, the others go on."""
    codec: Codec[Any] = Codec(CoordinatorCommand)

    def good(txid: str) -> dict[str, Any]:
        return {"txid": txid, "messages": [{"topic": "orders", "body": b"x"}]}

    head = {"type": "PrepareBatch", "version": PROTOCOL_VERSION, "group": "g", "producer": "p"}
    items = [good("t1"), {**good("t2"), "txid": 5}, good("t3"), 7, {**good("t4"), "messages": "m"}]
    batch = codec.decode(encode({**head, "items": items}, encoding), encoding)
    assert isinstance(batch, PrepareBatch)
    assert refusal(batch) is None, "the batch itself passes"
    assert [refusal(p) for p in prepares_of(batch)] == [
        None,
        "Expected `str`, got `int` - at `$.txid`",
        None,
        "Expected `object`, got `int`",
        "Expected `array`, got `str` - at `$.messages`",
    ]
    assert [p.txid for p in prepares_of(batch) if isinstance(p, Prepare)] == ["t1", "t3"]

    ends = [
        {"txid": "t1", "token": TOKEN, "decision": "commit"},
        {"txid": "t2", "token": TOKEN, "decision": "maybe"},
        {"txid": "t3", "token": 7, "decision": "commit"},
    ]
    end_batch = codec.decode(
        encode({"type": "EndBatch", "version": PROTOCOL_VERSION, "items": ends}, encoding),
        encoding,
    )
    assert isinstance(end_batch, EndBatch)
    assert [refusal(e) for e in ends_of(end_batch)] == [
        None,
        "Invalid enum value 'maybe' - at `$.decision`",
        "Expected `str`, got `int` - at `$.token`",
    ]

    for whole in ({**head, "group": 5}, {**head, "version": "3"}, {**head, "items": 5}):
        refused = codec.decode(encode({"items": items, **whole}, encoding), encoding)
        assert isinstance(refused, Error) and refused.code == "bad_request", refused
    assert codec.decode(encode({**head, "items": [good("t1")]}, encoding), encoding) == (
        prepare_batch(PrepareItem(txid="t1", messages=[message()]), producer="p")
    )


@pytest.mark.parametrize("encoding", list(Encoding))
@pytest.mark.parametrize("tag", [[1], {"a": 1}, None, 5])
def test_a_type_that_is_no_name_is_a_bad_request_not_a_crash(encoding: Encoding, tag: Any) -> None:
    decoded = Codec(CoordinatorCommand).decode(
        encode({"type": tag, "version": PROTOCOL_VERSION}, encoding), encoding
    )
    assert isinstance(decoded, Error) and decoded.code == "bad_request", decoded


def test_an_item_error_is_cut_to_its_bound() -> None:
    short = Error(ErrorCode.FORBIDDEN, "wrong token")
    assert item_error(short) is short
    cut = item_error(Error(ErrorCode.BAD_REQUEST, "x" * 10_000, 0.5))
    assert len(cut.message) == MAX_ITEM_ERROR_CHARS and cut.message.endswith("...")
    assert (cut.code, cut.retry_after) == (ErrorCode.BAD_REQUEST, 0.5)


seqs = st.integers(1, 2**64 - 1)
texts = st.text(max_size=2 * MAX_ITEM_ERROR_CHARS) | st.just("\x00" * 2 * MAX_ITEM_ERROR_CHARS)
errors = st.builds(
    lambda code, text, after: item_error(Error(code, text, after)),
    st.sampled_from(list(ErrorCode)),
    texts,
    st.none() | st.floats(),
)
txids = st.text("abcXYZ019_-", min_size=1, max_size=layout.NAME_MAX_LENGTH["txid"])


@st.composite
def answered_prepare_batches(draw: st.DrawFn) -> tuple[PrepareBatch, PreparedBatch]:
    """A batch and any answer it may get: per item, an error or one sequence per message."""
    counts = draw(st.lists(st.integers(1, 40), min_size=1, max_size=8))
    items = [PrepareItem(txid="t", messages=[message()] * n) for n in counts]
    results: list[Prepared | Error] = [
        draw(
            errors
            | st.builds(
                Prepared,
                txid=txids,
                token=st.just(TOKEN),
                seqs=st.lists(seqs, min_size=n, max_size=n),
            )
        )
        for n in counts
    ]
    return prepare_batch(*items), PreparedBatch(results=results)


@st.composite
def answered_end_batches(draw: st.DrawFn) -> tuple[EndBatch, EndedBatch]:
    states = st.sampled_from([*TxnState, *Gone]).map(str)
    results: list[Ended | Error] = draw(
        st.lists(errors | st.builds(Ended, txid=txids, state=states), min_size=1, max_size=8)
    )
    return end_batch(*["t"] * len(results)), EndedBatch(results=results)


@settings(max_examples=200, deadline=None)
@given(answered_prepare_batches() | answered_end_batches(), st.sampled_from(list(Encoding)))
def test_a_batch_is_answerable_only_if_any_answer_it_may_get_fits(
    answered: tuple[Any, Any], encoding: Encoding
) -> None:
    """`answerable_items` counts each item at its longest answer: given exactly the room its
    actual answer takes, never less, every item is answerable; given a byte less than the
    bound, not all are."""
    batch, answer = answered
    size = len(encode(answer, encoding))
    assert answerable_items(batch, 40, size - 1) < len(batch.items)
