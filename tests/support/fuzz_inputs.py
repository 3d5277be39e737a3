"""Hypothesis strategies for everything a client can throw at the coordinator, in one place.

A generated input is plain data (`Request`, `Flow`, `RawFrame`, `CheckAnswer`); sending it
and judging the outcome is the harness's job (tests/support/fuzz_harness.py). Every field
strategy yields `(value, Verdict)`: whether the protocol must accept the value, must refuse
it with `bad_request`, or may do either (a limit whose exact value the docs set). A command's
verdict is the worst of its fields', so the harness knows which answer each input is owed.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

import msgspec
from hypothesis import strategies as st

from txactors import layout
from txactors.protocol import Decision

DEFAULT_MAX_PAYLOAD = 1024 * 1024
HEADER_LIMIT = 64 * 1024
"""JetStream refuses a message whose header block exceeds this."""
TXID_POOL = ("t0", "t1", "t2", "shared-txid")
"""Few txids, so inputs collide: the same txid prepared twice, ended, resolved by an admin."""
TOPIC_POOL = ("fz", "fz-2")
PROBE_GROUP = "zz-probe"
"""The probe producer's group; no strategy draws it, so garbage check answers never reach it."""


class Verdict(enum.IntEnum):
    """What the protocol owes a value; a command takes the worst (highest) of its fields."""

    OK = 0
    MAYBE = 1
    """Accepted, or refused with bad_request (a documented limit); never anything worse."""
    BAD = 2
    """Must be refused with bad_request."""


class Expect(enum.Enum):
    ANSWER = "any answer that is not `internal`"
    REFUSED = "an Error that is not `internal`"
    BAD_REQUEST = "Error bad_request"
    REJECTED = "Error bad_request or unknown_command"
    NO_ANSWER = "nothing (hostile reply subject or raw frame)"


@dataclass(frozen=True)
class Request:
    """One publish on a coordinator subject, with a fresh inbox unless `reply` is hostile."""

    label: str
    subject: str
    payload: bytes
    expect: Expect
    headers: dict[str, str] | None = None
    reply: str | None = None
    command: dict[str, Any] | None = field(default=None, compare=False)
    """The command as built, when it was one: the ledger learns what a Prepared stands for."""


@dataclass(frozen=True)
class Flow:
    """A full transaction with odd but well-typed content: prepare, then end with `decision`
    (None: no end, the check-back decides). Whatever is accepted must work end to end."""

    label: str
    partition: int
    prepare: dict[str, Any]
    verdict: Verdict
    decision: Decision | None


@dataclass(frozen=True)
class RawFrame:
    """An HPUB written on a raw socket: a header block nats-py's parser would never build."""

    label: str
    subject: str
    header_block: bytes
    payload: bytes


@dataclass(frozen=True)
class CheckAnswer:
    """How the fake producer answers the next check-back it gets."""

    label: str
    kind: str
    """echo (a well-formed CheckResult), mismatch (wrong txid/check_id), bytes, error, none."""
    resolution: str = Decision.COMMIT.value
    garbage: bytes = b""
    json: bool = False


FuzzInput = Request | Flow | RawFrame | CheckAnswer

Field = st.SearchStrategy[tuple[Any, Verdict]]


def ok(strategy: st.SearchStrategy[Any]) -> Field:
    return strategy.map(lambda v: (v, Verdict.OK))


def maybe(strategy: st.SearchStrategy[Any]) -> Field:
    return strategy.map(lambda v: (v, Verdict.MAYBE))


def bad(strategy: st.SearchStrategy[Any]) -> Field:
    return strategy.map(lambda v: (v, Verdict.BAD))


# -- scalar values ------------------------------------------------------------------------

NAME_CHARS = "abcXYZ019_-"
valid_names = st.text(NAME_CHARS, min_size=1, max_size=12).filter(lambda s: s != layout.NO_TAG)

wrong_types: st.SearchStrategy[Any] = st.one_of(
    st.integers(),
    st.floats(),
    st.booleans(),
    st.binary(max_size=8),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
"""Values of a type no string field takes (None is a value some fields accept)."""


def long_name(length: int) -> str:
    return ("abc-_XYZ019" * (length // 11 + 1))[:length]


def names(pool: tuple[str, ...] = ()) -> Field:
    """A txid, group, producer id, topic or tag: valid, at a length boundary, or not a name."""
    return st.one_of(
        ok(st.sampled_from(pool) if pool else valid_names),
        ok(valid_names),
        maybe(st.sampled_from([64, 128, 255, 256, 1000, 4096]).map(long_name)),
        bad(st.sampled_from([20_000, 70_000, 300_000]).map(long_name)),
        bad(st.just("")),
        bad(
            st.tuples(
                valid_names, st.sampled_from([".", " ", "*", ">", "\n", "\r\n", "\x00", "é", "/"])
            ).map("".join)
        ),
        bad(st.text(min_size=1, max_size=6).filter(lambda s: not s.isascii())),
        bad(wrong_types),
    )


RESERVED_SPELLINGS = (
    "Nats-Msg-Id",
    " nats-expected-stream",
    "NATS-EXPECTED-LAST-SUBJECT-SEQUENCE",
    "nats-msg-id",
    "nAtS-Rollup",
    "\tNats-Msg-Id",
    "Nats-Msg-Id ",
    "Nats-TTL",
    "txn-id",
    "TXN-TOKEN",
    " Txn-Topic",
    "Content-Type",
)
"""Property names that spell a NATS/JetStream or txactors header (or the encoding header)."""

property_names: Field = st.one_of(
    ok(st.text("abcXYZ019_-", min_size=1, max_size=10)),
    maybe(st.sampled_from(["café", "名前", "Ünïcode"])),
    bad(st.sampled_from(RESERVED_SPELLINGS)),
    bad(st.sampled_from(["a b", "a:b", "a\r\nNats-Msg-Id", "", ":", "x\x00", "a\tb"])),
    bad(st.sampled_from([HEADER_LIMIT, 100_000]).map(long_name)),
)

property_values: Field = st.one_of(
    ok(st.text("abc XYZ019_-=/", max_size=20)),
    maybe(st.sampled_from(["café", "日本語", "\u00a0nbsp", "emoji 🙂"])),
    maybe(st.sampled_from(["x\r\nNats-Msg-Id: forged", "a\nb", "\r\n\r\n", "x\x00y"])),
    maybe(st.sampled_from([1000, 30_000, HEADER_LIMIT - 2048]).map(lambda n: "v" * n)),
    bad(st.sampled_from([HEADER_LIMIT, HEADER_LIMIT + 1, 200_000]).map(lambda n: "v" * n)),
)

keys: Field = st.one_of(
    ok(st.text("abc019-_", min_size=1, max_size=8)),
    maybe(st.sampled_from(["café", "键", "a b", "x\r\ny"])),
    bad(st.sampled_from(["a,b", ","])),
    bad(st.sampled_from([HEADER_LIMIT, 100_000]).map(lambda n: "k" * n)),
)

immunities: Field = st.one_of(
    ok(st.none()),
    ok(st.floats(min_value=0, max_value=3600)),
    maybe(st.sampled_from([-1.0, -1e308, 1e308, 3601.0, 0.0])),
    bad(st.sampled_from([math.nan, math.inf, -math.inf])),
    bad(st.text(max_size=3)),
)

decisions: Field = st.one_of(
    ok(st.sampled_from([d.value for d in Decision])),
    bad(st.sampled_from(["COMMIT", "Commit", "", "done", "commit\n"])),
    bad(wrong_types),
)

tokens: Field = st.one_of(
    ok(st.none()),
    maybe(st.text("0123456789abcdef", min_size=32, max_size=32)),
    maybe(st.text(max_size=40)),
    maybe(st.just("x" * 100_000)),
    bad(wrong_types.filter(lambda v: v is not None)),
)


def combine(**fields: Field) -> st.SearchStrategy[tuple[dict[str, Any], Verdict]]:
    """A dict of drawn fields and the worst verdict among them."""

    def join(drawn: dict[str, tuple[Any, Verdict]]) -> tuple[dict[str, Any], Verdict]:
        verdict = max((v for _, v in drawn.values()), default=Verdict.OK)
        return {k: value for k, (value, _) in drawn.items()}, Verdict(verdict)

    return st.fixed_dictionaries(fields).map(join)


def listed(element: Field, *, min_size: int = 0, max_size: int = 3) -> Field:
    def join(drawn: list[tuple[Any, Verdict]]) -> tuple[list[Any], Verdict]:
        return [v for v, _ in drawn], Verdict(max((v for _, v in drawn), default=Verdict.OK))

    return st.lists(element, min_size=min_size, max_size=max_size).map(join)


def properties() -> Field:
    def join(pairs: list[tuple[tuple[Any, Verdict], tuple[Any, Verdict]]]) -> tuple[Any, Verdict]:
        verdict = max((max(n[1], v[1]) for n, v in pairs), default=Verdict.OK)
        return {n[0]: v[0] for n, v in pairs}, Verdict(verdict)

    return st.lists(st.tuples(property_names, property_values), max_size=3).map(join)


def bodies(max_payload: int) -> Field:
    """Bytes, at most a few of them drawn: big bodies are a size and a fill byte."""
    near = [max_payload - 4096, max_payload - 2048, max_payload - 1024]
    return st.one_of(
        ok(st.binary(max_size=64)),
        maybe(st.sampled_from(near).map(lambda n: b"b" * n)),
        bad(st.sampled_from([max_payload - 300, max_payload - 64]).map(lambda n: b"b" * n)),
        bad(wrong_types.filter(lambda v: not isinstance(v, bytes))),
    )


def outgoing(max_payload: int) -> st.SearchStrategy[tuple[dict[str, Any], Verdict]]:
    return combine(
        topic=names(TOPIC_POOL),
        body=bodies(max_payload),
        keys=listed(keys),
        tag=st.one_of(ok(st.none()), names()),
        properties=properties(),
        check_immunity=immunities,
    )


def message_lists(max_payload: int) -> Field:
    many = st.sampled_from([1000, 1001, 5000]).map(
        lambda n: ([{"topic": "fz", "body": b""}] * n, Verdict.MAYBE if n <= 1000 else Verdict.BAD)
    )
    return st.one_of(
        listed(outgoing(max_payload), min_size=1, max_size=3),
        bad(st.just([])),
        many,
        bad(wrong_types),
    )


# -- commands -------------------------------------------------------------------------------


def prepare_commands(max_payload: int) -> st.SearchStrategy[tuple[dict[str, Any], Verdict]]:
    return combine(
        txid=names(TXID_POOL),
        group=names(("fzgroup",)),
        producer=names(("fzprod",)),
        messages=message_lists(max_payload),
        token=tokens,
    ).map(lambda cv: ({"type": "Prepare", **cv[0]}, cv[1]))


def end_commands() -> st.SearchStrategy[tuple[dict[str, Any], Verdict]]:
    return combine(
        txid=names(TXID_POOL), token=tokens.filter(lambda tv: tv[0] is not None), decision=decisions
    ).map(lambda cv: ({"type": "EndTransaction", **cv[0]}, cv[1]))


def admin_commands() -> st.SearchStrategy[tuple[dict[str, Any], Verdict]]:
    by_txid = st.sampled_from(
        ["ShowTransaction", "ResumeTransaction", "CommitTransaction", "RollbackTransaction"]
    )
    states = listed(
        st.one_of(
            ok(st.sampled_from(["prepared", "checking", "discarded", "committed"])),
            maybe(st.text(max_size=8)),
        )
    )
    return st.one_of(
        combine(states=states).map(lambda cv: ({"type": "ListTransactions", **cv[0]}, cv[1])),
        st.tuples(by_txid, combine(txid=names(TXID_POOL))).map(
            lambda t: ({"type": t[0], **t[1][0]}, t[1][1])
        ),
    )


def drop_or_add_fields(
    command: st.SearchStrategy[tuple[dict[str, Any], Verdict]],
) -> st.SearchStrategy[tuple[dict[str, Any], Verdict]]:
    """Now and then a command with a required field missing or an unknown one added."""

    @st.composite
    def mutate(draw: st.DrawFn) -> tuple[dict[str, Any], Verdict]:
        fields, verdict = draw(command)
        how = draw(st.sampled_from(["as is", "as is", "as is", "drop", "extra"]))
        if how == "drop" and len(fields) > 1:
            name = draw(st.sampled_from(sorted(k for k in fields if k != "type")))
            optional = {"token", "states", "keys", "tag", "properties", "check_immunity"}
            return {k: v for k, v in fields.items() if k != name}, (
                verdict if name in optional else Verdict.BAD
            )
        if how == "extra":
            return {**fields, "zz_unknown": draw(wrong_types)}, verdict
        return fields, verdict

    return mutate()


# -- encodings ------------------------------------------------------------------------------

JSON = {"Content-Type": "application/json"}


def encode_json(command: dict[str, Any]) -> bytes:
    """JSON as another language's client writes it: bytes as base64, NaN and infinity as the
    literals `NaN` and `1e999` (which decodes to infinity), not msgspec's `null`."""
    text = msgspec.json.encode(_mark_non_finite(command))
    for marker, literal in _NON_FINITE.items():
        text = text.replace(b'"' + marker.encode() + b'"', literal)
    return text


_NON_FINITE = {"~nan~": b"NaN", "~inf~": b"1e999", "~-inf~": b"-1e999"}


def _mark_non_finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "~nan~" if math.isnan(value) else ("~inf~" if value > 0 else "~-inf~")
    if isinstance(value, dict):
        return {str(k): _mark_non_finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_mark_non_finite(v) for v in value]
    return value


@st.composite
def encoded(
    draw: st.DrawFn, command: st.SearchStrategy[tuple[dict[str, Any], Verdict]]
) -> tuple[bytes, dict[str, str] | None, dict[str, Any], Verdict]:
    fields, verdict = draw(command)
    if draw(st.booleans()):
        return msgspec.msgpack.encode(fields), None, fields, verdict
    return encode_json(fields), dict(JSON), fields, verdict


def nested(depth: int, *, as_json: bool) -> bytes:
    """A Prepare whose `messages` is `depth` lists deep: parsers recurse, and must not die."""
    if as_json:
        return b'{"type":"Prepare","txid":"t0","group":"g","producer":"p","messages":' + (
            b"[" * depth + b"]" * depth + b"}"
        )
    head = msgspec.msgpack.encode({"type": "Prepare", "txid": "t0", "group": "g", "producer": "p"})
    # fixmap of 4 → 5 entries, then "messages": [[[...]]]
    return (
        bytes([head[0] + 1])
        + head[1:]
        + msgspec.msgpack.encode("messages")
        + b"\x91" * depth
        + b"\x90"
    )


def invalid_utf8(as_json: bool) -> bytes:
    if as_json:
        return b'{"type":"Prepare","txid":"t\xff\xfe","group":"g","producer":"p","messages":[]}'
    # a msgpack str whose bytes are not UTF-8
    head = msgspec.msgpack.encode({"type": "Prepare", "txid": "PLACEHOLDER"})
    return head.replace(b"\xabPLACEHOLDER", b"\xa3t\xff\xfe")


# -- whole inputs -----------------------------------------------------------------------------


def _expect_for(verdict: Verdict) -> Expect:
    return Expect.BAD_REQUEST if verdict is Verdict.BAD else Expect.ANSWER


def command_requests(partitions: int, max_payload: int) -> st.SearchStrategy[Request]:
    """Typed commands (with odd fields) on their own subject, and on the wrong ones."""
    verbs = [
        ("prepare", layout.prepare_subject, drop_or_add_fields(prepare_commands(max_payload))),
        ("end", layout.end_subject, drop_or_add_fields(end_commands())),
        ("admin", layout.admin_subject, drop_or_add_fields(admin_commands())),
    ]

    @st.composite
    def build(draw: st.DrawFn) -> Request:
        verb, subject_of, command = draw(st.sampled_from(verbs))
        payload, headers, fields, verdict = draw(encoded(command))
        txid = fields.get("txid")
        own = (
            layout.partition_of(txid, partitions)
            if isinstance(txid, str) and txid.isascii()
            else None
        )
        partition = draw(st.integers(0, partitions - 1))
        expect = _expect_for(verdict)
        if verb == "prepare" and own is not None and partition != own and expect is Expect.ANSWER:
            expect = Expect.REFUSED  # a txid prepared on a partition that does not own it
        elif verb == "end" and expect is Expect.ANSWER:
            expect = Expect.REFUSED  # a drawn token is never the one the coordinator made
        if draw(st.integers(0, 9)) == 0:  # a well-formed command on another verb's subject
            others = [s for v, s, _ in verbs if v != verb]
            subject_of = draw(st.sampled_from(others))
            expect = Expect.REJECTED if verdict is not Verdict.BAD else Expect.BAD_REQUEST
        return Request(
            label=f"{verb} {fields.get('type')} ({verdict.name}, {'json' if headers else 'mp'})",
            subject=subject_of(partition),
            payload=payload,
            headers=headers,
            expect=expect,
            command=fields,
        )

    return build()


def raw_requests(partitions: int) -> st.SearchStrategy[Request]:
    """Bytes that are not a command: garbage, bad UTF-8, deep nesting, odd Content-Types."""
    subjects = st.sampled_from(
        [
            f(p)
            for p in range(partitions)
            for f in (layout.prepare_subject, layout.end_subject, layout.admin_subject)
        ]
    )
    content_types = st.one_of(
        st.none(),
        st.just(JSON),
        st.sampled_from(["text/plain", "application/jsonx", "", "application/x-msgpack"]).map(
            lambda v: {"Content-Type": v}
        ),
    )
    garbage = st.builds(
        lambda s, b, h: Request("garbage bytes", s, b, Expect.REJECTED, headers=h),
        subjects,
        st.binary(max_size=200),
        content_types,
    )
    unknown = st.builds(
        lambda s, j: Request(
            "unknown type",
            s,
            msgspec.json.encode({"type": "Bogus"})
            if j
            else msgspec.msgpack.encode({"type": "Bogus"}),
            Expect.REJECTED,
            headers=dict(JSON) if j else None,
        ),
        subjects,
        st.booleans(),
    )
    utf8 = st.builds(
        lambda s, j: Request(
            "invalid UTF-8", s, invalid_utf8(j), Expect.BAD_REQUEST, dict(JSON) if j else None
        ),
        subjects,
        st.booleans(),
    )
    deep = st.builds(
        lambda s, d, j: Request(
            f"nested {d} deep",
            s,
            nested(d, as_json=j),
            Expect.BAD_REQUEST,
            dict(JSON) if j else None,
        ),
        subjects,
        st.sampled_from([1000, 10_000, 100_000]),
        st.booleans(),
    )
    return st.one_of(garbage, unknown, utf8, deep)


def hostile_replies(partitions: int, topic: str) -> list[str]:
    """Reply subjects that are not inboxes: the coordinator must never publish there."""
    return [
        f"topic.{topic}.x",
        *(f"$KV.{layout.LEASE_BUCKET}.{p}" for p in range(partitions)),
        *(layout.op_subject(p) for p in range(partitions)),
        *(layout.half_subject(p) for p in range(partitions)),
        f"$JS.API.STREAM.PURGE.{layout.topic_stream(topic)}",
        f"$KV.{layout.CHECKPOINT_BUCKET}.0",
    ]


def reply_injections(partitions: int, max_payload: int, topic: str) -> st.SearchStrategy[Request]:
    """Any request, answered (it must not be) to a subject that is not an inbox."""
    replies = st.sampled_from(hostile_replies(partitions, topic))
    inner = st.one_of(command_requests(partitions, max_payload), raw_requests(partitions))
    return st.builds(
        lambda r, reply: Request(
            f"reply={reply} on {r.label}",
            r.subject,
            r.payload,
            Expect.NO_ANSWER,
            headers=r.headers,
            reply=reply,
            command=r.command,
        ),
        inner,
        replies,
    )


def flows(partitions: int, max_payload: int) -> st.SearchStrategy[Flow]:
    """Well-typed transactions with odd content, prepared on the txid's own partition."""
    typed = combine(
        group=ok(st.just("fzgroup")),
        producer=ok(st.just("fzprod")),
        messages=listed(outgoing(max_payload), min_size=1, max_size=2),
    )

    @st.composite
    def build(draw: st.DrawFn) -> Flow:
        fields, verdict = draw(typed.filter(lambda cv: _well_typed(cv[0]["messages"])))
        txid = "fl" + draw(st.text("0123456789abcdef", min_size=12, max_size=12))
        decision = draw(st.sampled_from([*Decision, None]))
        prepare = {"type": "Prepare", "txid": txid, **fields}
        return Flow(
            label=f"flow {decision and decision.value} ({verdict.name})",
            partition=layout.partition_of(txid, partitions),
            prepare=prepare,
            verdict=verdict,
            decision=decision,
        )

    return build()


def _well_typed(messages: list[dict[str, Any]]) -> bool:
    """Flows test content, not types: every field has the type the Struct declares."""
    for m in messages:
        if not isinstance(m["topic"], str) or not isinstance(m["body"], bytes):
            return False
        if m["tag"] is not None and not isinstance(m["tag"], str):
            return False
        if not isinstance(m["check_immunity"], float | type(None)):
            return False
    return True


MALFORMED_HEADER_BLOCKS = (
    b"\r\n\r\n",
    b"NATS",
    b"NATS/1.0\r\n",
    b"NATS/1.0\r\nX\r\n\r\n",
    b"NATS/1.0\r\n:\r\n\r\n",
    b"NATS/1.0\r\nContent-Type\r\n\r\n",
    b"NATS/1.0 503\r\n\r\n",
    b"NATS/1.0\r\n\xff\xfe: \xff\r\n\r\n",
    b"HTTP/1.1\r\nA: b\r\n\r\n",
)
"""Header blocks nats-server forwards as they are and a client's parser must survive."""


def raw_frames(partitions: int) -> st.SearchStrategy[RawFrame]:
    subjects = st.sampled_from(
        [f(p) for p in range(partitions) for f in (layout.prepare_subject, layout.admin_subject)]
    )
    return st.builds(
        lambda s, h, b: RawFrame(f"raw header block {h!r}", s, h, b),
        subjects,
        st.sampled_from(MALFORMED_HEADER_BLOCKS),
        st.sampled_from([b"", msgspec.msgpack.encode({"type": "ListTransactions"})]),
    )


check_answers: st.SearchStrategy[CheckAnswer] = st.one_of(
    st.builds(
        lambda r, j: CheckAnswer(f"check echo {r!r}", "echo", resolution=r, json=j),
        st.sampled_from([*(d.value for d in Decision), "COMMIT", "", "maybe"]),
        st.booleans(),
    ),
    st.builds(
        lambda r: CheckAnswer("check mismatched txid/check_id", "mismatch", resolution=r),
        st.sampled_from([d.value for d in Decision]),
    ),
    st.builds(
        lambda b: CheckAnswer("check garbage bytes", "bytes", garbage=b), st.binary(max_size=64)
    ),
    st.just(CheckAnswer("check Error reply", "error")),
    st.just(CheckAnswer("check no answer", "none")),
    st.just(CheckAnswer("check nested", "bytes", garbage=b"\x91" * 100_000 + b"\x90")),
)


def fuzz_inputs(
    partitions: int, max_payload: int = DEFAULT_MAX_PAYLOAD, topic: str = "probe"
) -> st.SearchStrategy[FuzzInput]:
    """Every kind of input, weighted toward typed commands (where the boundary's rules are)."""
    commands = command_requests(partitions, max_payload)
    return st.one_of(
        commands,
        commands,
        raw_requests(partitions),
        reply_injections(partitions, max_payload, topic),
        flows(partitions, max_payload),
        flows(partitions, max_payload),
        raw_frames(partitions),
        check_answers,
    )


def batches(
    partitions: int, max_payload: int = DEFAULT_MAX_PAYLOAD, topic: str = "probe"
) -> st.SearchStrategy[list[FuzzInput]]:
    return st.lists(fuzz_inputs(partitions, max_payload, topic), min_size=1, max_size=6)
