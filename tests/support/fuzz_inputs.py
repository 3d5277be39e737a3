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

from tests.support.rawnats import MALFORMED_BLOCKS
from txactors.coordinator.core.states import TxnState
from txactors.wire import layout
from txactors.wire.protocol import Decision

DEFAULT_MAX_PAYLOAD = 1024 * 1024
HEADER_LIMIT = 64 * 1024
"""JetStream refuses a message whose header block exceeds this."""
TXID_POOL = ("t0", "t1", "t2", "shared-txid")
"""Few txids, so inputs collide: the same txid prepared twice, ended, resolved by an admin."""
TOPIC_POOL = ("fz", "fz-2")
PROBE_GROUP = "zz-probe"
"""The probe producer's group; no strategy draws it, so garbage check answers never reach it."""
GROUP = "fzgroup"
"""The producer group of the fuzzed commands and flows: their prepare and end subjects name it,
as a producer's do."""


def prepare_on(partition: int) -> str:
    return layout.prepare_subject(partition, GROUP)


def end_on(partition: int) -> str:
    return layout.end_subject(partition, GROUP)


class Verdict(enum.IntEnum):
    """What the protocol owes a value; a command takes the worst (highest) of its fields."""

    OK = 0
    MAYBE = 1
    """Accepted, or refused with bad_request (a documented limit); never anything worse."""
    BAD = 2
    """Must be refused with bad_request."""


class Expect(enum.Enum):
    ANSWER = "any answer that is not `internal`"
    VALID = "any answer but `bad_request` or `internal` (the input is within every limit)"
    ACCEPTED = "Prepared"
    REFUSED = "an Error other than `bad_request` or `internal` (valid, but not allowed)"
    BAD_REQUEST = "Error bad_request"
    UNSUPPORTED = "Error unsupported_version (a newer version, or version 1: removed in 0.x)"
    REJECTED = "Error bad_request or unknown_command"
    NO_ANSWER = "nothing (hostile or no reply subject, or raw frame)"


@dataclass(frozen=True)
class Request:
    """One publish on a coordinator subject, with a fresh inbox unless `reply` is hostile."""

    label: str
    subject: str
    payload: bytes = field(repr=False)
    expect: Expect
    headers: dict[str, str] | None = None
    reply: str | None = None
    """None: a fresh inbox; "": no reply subject at all (a one-way request)."""
    command: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    """The command as built, when it was one: the ledger learns what a Prepared stands for."""
    never_prepared: str | None = None
    """A txid that must not exist after the batch: this request was not to be executed."""
    items: tuple[Expect, ...] | None = None
    """A batch command: what each item is owed in the batch's answer, when it gets one."""
    whole: frozenset[str] = frozenset()
    """A batch command: the codes of an `Error` that may answer it instead (refused whole)."""


@dataclass(frozen=True)
class Flow:
    """A full transaction with odd but well-typed content: prepare, then end with `decision`
    (None: no end, the check-back decides), acknowledged or `oneway`. Whatever is accepted
    must work end to end."""

    label: str
    partition: int
    prepare: dict[str, Any] = field(repr=False)
    verdict: Verdict
    decision: Decision | None
    oneway: bool = False

    @property
    def group(self) -> str:
        """The producer group the flow prepares and ends as, on the subjects that name it."""
        group = self.prepare.get("group")
        return group if isinstance(group, str) else GROUP


@dataclass(frozen=True)
class RawFrame:
    """An HPUB written on a raw socket: a header block nats-py's parser would never build."""

    label: str
    subject: str
    header_block: bytes
    payload: bytes = field(repr=False)
    answered: bool = True
    """Sent with an inbox reply subject and owed an answer (`bad_request` if the block cannot
    be parsed); otherwise sent with a reply subject nobody serves."""
    expect: Expect = Expect.ANSWER


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


def bad(strategy: st.SearchStrategy[Any]) -> Field:
    return strategy.map(lambda v: (v, Verdict.BAD))


@dataclass(frozen=True)
class Spec:
    """A field's values the protocol must accept and those it must refuse. `valid=True`
    draws only the former: a command built of valid fields reaches the rules a refusal
    of any one field would hide (ownership, tokens, conflicts, sizes)."""

    oks: tuple[st.SearchStrategy[Any], ...]
    bads: tuple[st.SearchStrategy[Any], ...] = ()

    def __call__(self, valid: bool = False) -> Field:
        branches = [ok(s) for s in self.oks] + ([] if valid else [bad(s) for s in self.bads])
        return st.one_of(*branches)


# -- scalar values ------------------------------------------------------------------------
# The limits below are docs/protocol.md#limits, restated here rather than imported: the suite
# checks the coordinator against the documented table, not against its own constants.

NAME_LIMITS = {"txid": 128, "group": 64, "producer": 128, "topic": 64, "tag": 64}
MAX_KEY = 256
MAX_PROPERTY_NAME = 128
MAX_IMMUNITY = 3600.0
MAX_MESSAGES = 1000
MAX_HALF_HEADERS = HEADER_LIMIT - 1 - 1024
"""JetStream's 65,535-byte header limit less the 1 KiB the coordinator keeps for later."""
PAYLOAD_RESERVE = 1024
"""A half's body and headers must fit in max_payload less this."""
COORDINATOR_HEADERS = (150, 1024)
"""Bounds on the bytes of the coordinator's own headers in a half (Txn-*, Nats-Msg-Id, with
names at their limits): a size within this band of a limit may go either way."""

NAME_CHARS = "abcXYZ019_-"
valid_names = st.text(NAME_CHARS, min_size=1, max_size=12).filter(lambda s: s != layout.NO_TAG)

wrong_types: st.SearchStrategy[Any] = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.booleans(),
    st.lists(st.integers(0, 9), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(0, 9), max_size=2),
)
"""Values of a type no string field takes (None is a value some fields accept). No bytes:
JSON carries them as base64 text, which a string field may well accept."""


def long_name(length: int) -> str:
    return ("abc-_XYZ019" * (length // 11 + 1))[:length]


def names(kind: str, pool: tuple[str, ...] = (), *, valid: bool = False) -> Field:
    """A txid, group, producer id, topic or tag: valid, at its documented length limit, one
    past it, or not a name at all (other characters, empty, another type)."""
    limit = NAME_LIMITS[kind]
    return Spec(
        oks=(
            st.sampled_from(pool) if pool else valid_names,
            valid_names,
            st.just(long_name(limit)),
        ),
        bads=(
            st.sampled_from([limit + 1, 255, 1000, 4096, 20_000, 70_000]).map(long_name),
            st.just(""),
            st.tuples(
                valid_names,
                st.sampled_from([".", " ", "*", ">", "\n", "\r\n", "\x00", "é", "/", ":"]),
            ).map("".join),
            st.text(min_size=1, max_size=6).filter(lambda s: not s.isascii()),
            wrong_types,
        ),
    )(valid)


def tags(*, valid: bool = False) -> Field:
    no_tag = () if valid else (bad(st.just(layout.NO_TAG)),)
    return st.one_of(ok(st.none()), names("tag", valid=valid), *no_tag)


def _reserved(name: str) -> bool:
    folded = name.strip().lower()
    return folded.startswith(("nats-", "txn-")) or folded in {
        "status",
        "description",
        "kv-operation",
    }


TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcXYZ"
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
    "Status",
    "description",
    "KV-Operation",
)
"""Property names that spell a NATS/JetStream or txactors control header, in any case."""

property_names = Spec(
    oks=(
        st.text(TOKEN_CHARS, min_size=1, max_size=10).filter(lambda s: not _reserved(s)),
        st.sampled_from(["Content-Type", "x-trace", "a.b", "~|`^"]),
        st.just("p" * MAX_PROPERTY_NAME),
    ),
    bads=(
        st.sampled_from(RESERVED_SPELLINGS),
        st.sampled_from(["café", "名前", "Ünïcode", "a b", "a:b", "a\r\nNats-Msg-Id", ""]),
        st.sampled_from([":", "x\x00", "a\tb", "(x)", "a,b", "a/b", "a@b"]),
        st.sampled_from([MAX_PROPERTY_NAME + 1, HEADER_LIMIT]).map(lambda n: "p" * n),
    ),
)

printable_text = st.text(
    st.characters(categories=["L", "M", "N", "P", "S"]) | st.just(" "), max_size=20
).filter(lambda s: s == s.strip())
"""Printable UTF-8 (non-ASCII included) without leading or trailing blanks."""

property_values = Spec(
    oks=(
        printable_text,
        st.sampled_from(["", "café", "日本語", "emoji 🙂", "a: b", "x=1; y=2"]),
        st.sampled_from([1000, 30_000]).map(lambda n: "v" * n),
        st.just("v" * (MAX_HALF_HEADERS - 512)),  # near the limit: `_sized` judges
    ),
    bads=(
        st.sampled_from(["x\r\nNats-Msg-Id: forged", "a\nb", "\r\n\r\n", "x\x00y"]),
        st.sampled_from([" lead", "trail ", "\tx", "\u00a0nbsp", "a\u2028b", "\x7f"]),
        st.sampled_from([HEADER_LIMIT, 200_000]).map(lambda n: "v" * n),
    ),
)

keys = Spec(
    oks=(
        printable_text.filter(lambda s: s and "," not in s and len(s) <= MAX_KEY),
        st.sampled_from(["café", "键", "a b", "k" * MAX_KEY]),
    ),
    bads=(
        st.sampled_from(["a,b", ",", "", " a", "a ", "x\r\ny", "a\x00"]),
        st.sampled_from([MAX_KEY + 1, HEADER_LIMIT]).map(lambda n: "k" * n),
    ),
)

immunities = Spec(
    oks=(
        st.none(),
        st.floats(min_value=0, max_value=MAX_IMMUNITY),
        st.sampled_from([0.0, MAX_IMMUNITY]),
    ),
    bads=(
        st.sampled_from([-1.0, -1e-9, -1e308, 1e308, MAX_IMMUNITY + 0.5]),
        st.sampled_from([math.nan, math.inf, -math.inf]),
        st.text(max_size=3),
    ),
)

MAX_LIST_LIMIT = 100_000
BATCH_CHARS = "abcXYZ019_-.:"
MAX_BATCH = 64

ages = Spec(
    oks=(st.none(), st.floats(min_value=0, max_value=1e12), st.just(0.0)),
    bads=(
        st.sampled_from([-1.0, -1e-9, -1e308]),
        st.sampled_from([math.nan, math.inf, -math.inf]),
        st.text(max_size=3),
    ),
)

list_limits = Spec(
    oks=(st.none(), st.integers(1, MAX_LIST_LIMIT), st.sampled_from([1, MAX_LIST_LIMIT])),
    bads=(st.sampled_from([0, -1, MAX_LIST_LIMIT + 1, 2**40]), st.floats(), st.text(max_size=3)),
)

batch_ids = Spec(
    oks=(
        st.none(),
        st.text(BATCH_CHARS, min_size=1, max_size=12),
        st.just("b" * MAX_BATCH),
    ),
    bads=(
        st.just(""),
        st.just("b" * (MAX_BATCH + 1)),
        st.text(min_size=1, max_size=6).filter(lambda s: not set(s) <= set(BATCH_CHARS)),
        wrong_types,
    ),
)

decisions = Spec(
    oks=(st.sampled_from([d.value for d in Decision]),),
    bads=(
        st.sampled_from(["COMMIT", "Commit", "", "done", "commit\n"]),
        wrong_types,
    ),
)

HEX = "0123456789abcdef"
tokens = Spec(
    oks=(
        st.none(),
        st.text(HEX, min_size=32, max_size=32),
    ),
    bads=(
        st.text(HEX.upper(), min_size=32, max_size=32).filter(lambda t: t != t.lower()),
        st.text(max_size=40).filter(lambda t: not (len(t) == 32 and set(t) <= set(HEX))),
        st.sampled_from([HEX * 2 + "0", "x" * 100_000]),
        wrong_types,
    ),
)
"""A token is null (a first prepare) or 32 lowercase hex digits; a well-formed one that is
not the transaction's is `forbidden` or `not_found`, never `bad_request`."""


PROTOCOL_VERSION = 3
"""docs/protocol.md#protocol-version, restated like the limits above."""
SERVED_VERSIONS = (2, 3)
"""A version 2 client's commands are still carried out."""
BATCH_VERSION = 3
"""A batch saying less is refused whole with bad_request."""
MAX_BATCH_ITEMS = 256


class Version(enum.Enum):
    """How a command's `version` field is drawn, and what it owes the command's answer."""

    CURRENT = "current"
    ABSENT = "absent"
    """A version 1 client's command (removed in 0.x): `unsupported_version` once its type is
    one the subject serves."""
    REMOVED = "removed"
    """`version: 1` (removed in 0.x): `unsupported_version`, like a newer one."""
    NEWER = "newer"
    BAD = "bad"


versions: st.SearchStrategy[tuple[Version, Any]] = st.one_of(
    *[st.just((Version.CURRENT, PROTOCOL_VERSION))] * 3,  # mostly: the other rules get a turn
    st.sampled_from(SERVED_VERSIONS).map(lambda v: (Version.CURRENT, v)),
    st.just((Version.ABSENT, None)),
    st.just((Version.REMOVED, 1)),
    st.sampled_from([PROTOCOL_VERSION + 1, 2**31, 2**64 - 1]).map(lambda v: (Version.NEWER, v)),
    st.sampled_from([0, -1, -(2**63), "2", 2.0, True, None, [2]]).map(lambda v: (Version.BAD, v)),
)


def _decodable(payload: bytes, json: bool) -> bool:
    """Whether the bytes are msgpack/JSON at all: a newer version is only recognised then."""
    try:
        (msgspec.json if json else msgspec.msgpack).decode(payload)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return False
    return True


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


def properties(*, valid: bool = False) -> Field:
    """A dict of drawn pairs; the verdict is judged on the pairs the dict kept."""

    def join(pairs: list[tuple[tuple[Any, Verdict], tuple[Any, Verdict]]]) -> tuple[Any, Verdict]:
        kept = {n[0]: (n[1], v) for n, v in pairs}
        verdict = max((max(nv, vv[1]) for nv, vv in kept.values()), default=Verdict.OK)
        return {name: value[0] for name, (_, value) in kept.items()}, Verdict(verdict)

    pair = st.tuples(property_names(valid), property_values(valid))
    return st.lists(pair, max_size=3).map(join)


def bodies(max_payload: int, *, valid: bool = False) -> Field:
    """Bytes, at most a few of them drawn: big bodies are a size and a fill byte (whether one
    fits beside its headers is for `_sized` to judge)."""
    near = [max_payload - 4096, max_payload - 2048, max_payload - 1024, max_payload - 300]
    return Spec(
        oks=(st.binary(max_size=64), st.sampled_from(near).map(lambda n: b"b" * n)),
        bads=(wrong_types,),
    )(valid)


def user_header_bytes(message: dict[str, Any]) -> int:
    """What the user's properties and keys add to a half's header block (`Name: Value\\r\\n`)."""
    total = sum(len(n.encode()) + len(v.encode()) + 4 for n, v in message["properties"].items())
    if message["keys"]:
        total += len("Txn-Keys") + len(",".join(message["keys"]).encode()) + 4
    return total


def _sized(
    max_payload: int, drawn: tuple[dict[str, Any], Verdict]
) -> tuple[dict[str, Any], Verdict]:
    """A well-typed message's verdict on the two size rules of the limits table: its headers
    (ours included) within MAX_HALF_HEADERS, its body and headers within max_payload less
    PAYLOAD_RESERVE. Certain when far from a limit, MAYBE within COORDINATOR_HEADERS of it."""
    message, verdict = drawn
    if verdict is Verdict.BAD or not isinstance(message["body"], bytes):
        return drawn
    low, high = COORDINATOR_HEADERS
    headers = user_header_bytes(message)
    total = headers + len(message["body"])
    payload_limit = max_payload - PAYLOAD_RESERVE
    if headers + low > MAX_HALF_HEADERS or total + low > payload_limit:
        return message, Verdict.BAD
    if headers + high > MAX_HALF_HEADERS or total + high > payload_limit:
        return message, max(verdict, Verdict.MAYBE)
    return drawn


def outgoing(
    max_payload: int, *, valid: bool = False
) -> st.SearchStrategy[tuple[dict[str, Any], Verdict]]:
    fields = combine(
        topic=names("topic", TOPIC_POOL, valid=valid),
        body=bodies(max_payload, valid=valid),
        keys=listed(keys(valid)),
        tag=tags(valid=valid),
        properties=properties(valid=valid),
        check_immunity=immunities(valid),
    )
    return fields.map(lambda drawn: _sized(max_payload, drawn))


def message_lists(max_payload: int, *, valid: bool = False) -> Field:
    many = st.sampled_from([MAX_MESSAGES, MAX_MESSAGES + 1, 5000]).map(
        lambda n: (
            [{"topic": "fz", "body": b""}] * n,
            Verdict.OK if n <= MAX_MESSAGES else Verdict.BAD,
        )
    )
    some = listed(outgoing(max_payload, valid=valid), min_size=1, max_size=3)
    if valid:
        return some
    return st.one_of(some, bad(st.just([])), many, bad(wrong_types))


# -- commands -------------------------------------------------------------------------------


def prepare_commands(
    max_payload: int, *, valid: bool = False
) -> st.SearchStrategy[tuple[dict[str, Any], Verdict]]:
    return combine(
        txid=names("txid", TXID_POOL, valid=valid),
        group=names("group", (GROUP,), valid=valid),
        producer=names("producer", ("fzprod",), valid=valid),
        messages=message_lists(max_payload, valid=valid),
        token=tokens(valid),
    ).map(lambda cv: ({"type": "Prepare", **cv[0]}, cv[1]))


def end_commands(*, valid: bool = False) -> st.SearchStrategy[tuple[dict[str, Any], Verdict]]:
    return combine(
        txid=names("txid", TXID_POOL, valid=valid),
        token=tokens(valid).filter(lambda tv: tv[0] is not None),
        decision=decisions(valid),
    ).map(lambda cv: ({"type": "EndTransaction", **cv[0]}, cv[1]))


def admin_commands(*, valid: bool = False) -> st.SearchStrategy[tuple[dict[str, Any], Verdict]]:
    by_action = st.sampled_from(["ResumeTransaction", "CommitTransaction", "RollbackTransaction"])
    states = listed(
        Spec(
            oks=(st.sampled_from([s.value for s in TxnState]),),
            bads=(st.text(max_size=8).filter(lambda s: s not in set(TxnState)),),
        )(valid)
    )
    listing = combine(
        states=states,
        group=st.one_of(ok(st.none()), names("group", valid=valid)),
        topic=st.one_of(ok(st.none()), names("topic", TOPIC_POOL, valid=valid)),
        older_than=ages(valid),
        limit=list_limits(valid),
    )
    show = combine(txid=names("txid", TXID_POOL, valid=valid))
    action = combine(txid=names("txid", TXID_POOL, valid=valid), batch=batch_ids(valid))
    return st.one_of(
        listing.map(lambda cv: ({"type": "ListTransactions", **cv[0]}, cv[1])),
        show.map(lambda cv: ({"type": "ShowTransaction", **cv[0]}, cv[1])),
        st.tuples(by_action, action).map(lambda t: ({"type": t[0], **t[1][0]}, t[1][1])),
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
            optional = {"token", "states", "keys", "tag", "properties", "check_immunity", "batch"}
            if fields.get("type") == "ListTransactions":
                optional |= {"group", "topic", "older_than", "limit"}
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
        return (
            b'{"type":"Prepare","version":2,"txid":"t0","group":"g","producer":"p","messages":'
            + (b"[" * depth + b"]" * depth + b"}")
        )
    head = msgspec.msgpack.encode(
        {
            "type": "Prepare",
            "version": PROTOCOL_VERSION,
            "txid": "t0",
            "group": "g",
            "producer": "p",
        }
    )
    # fixmap of 5 → 6 entries, then "messages": [[[...]]]
    return (
        bytes([head[0] + 1])
        + head[1:]
        + msgspec.msgpack.encode("messages")
        + b"\x91" * depth
        + b"\x90"
    )


def invalid_utf8(as_json: bool) -> bytes:
    if as_json:
        return (
            b'{"type":"Prepare","version":2,"txid":"t\xff\xfe","group":"g","producer":"p",'
            b'"messages":[]}'
        )
    # a msgpack str whose bytes are not UTF-8
    head = msgspec.msgpack.encode(
        {"type": "Prepare", "version": PROTOCOL_VERSION, "txid": "PLACEHOLDER"}
    )
    return head.replace(b"\xabPLACEHOLDER", b"\xa3t\xff\xfe")


# -- whole inputs -----------------------------------------------------------------------------


def _expect_for(verb: str, fields: dict[str, Any], verdict: Verdict) -> Expect:
    """What a command on its own verb's subject and its txid's own partition is owed."""
    if verdict is Verdict.BAD:
        return Expect.BAD_REQUEST
    if verdict is Verdict.MAYBE:
        return Expect.ANSWER
    if verb == "end" or (verb == "prepare" and fields.get("token") is not None):
        return Expect.REFUSED  # a drawn token is never the one the coordinator made
    return Expect.VALID


def command_requests(partitions: int, max_payload: int) -> st.SearchStrategy[Request]:
    """Typed commands (with odd fields) on their own subject, and on the wrong ones."""
    verbs = [
        (
            "prepare",
            prepare_on,
            st.one_of(
                prepare_commands(max_payload, valid=True),
                drop_or_add_fields(prepare_commands(max_payload)),
            ),
        ),
        (
            "end",
            end_on,
            st.one_of(end_commands(valid=True), drop_or_add_fields(end_commands())),
        ),
        (
            "admin",
            layout.admin_subject,
            st.one_of(admin_commands(valid=True), drop_or_add_fields(admin_commands())),
        ),
    ]

    @st.composite
    def build(draw: st.DrawFn) -> Request:
        verb, subject_of, command = draw(st.sampled_from(verbs))
        version, number = draw(versions)
        if version is not Version.ABSENT:
            command = command.map(lambda cv: ({**cv[0], "version": number}, cv[1]))
        payload, headers, fields, verdict = draw(encoded(command))
        decodable = _decodable(payload, headers is not None)
        txid = fields.get("txid")
        own = layout.partition_of(txid, partitions) if isinstance(txid, str) else None
        partition = draw(st.integers(0, partitions - 1))
        if own is not None and draw(st.integers(0, 3)):
            partition = own  # mostly: the boundary's other rules get a chance too
        expect = _expect_for(verb, fields, verdict)
        if own is not None and partition != own:
            expect = Expect.BAD_REQUEST  # a txid sent to a partition that does not own it
        if draw(st.integers(0, 9)) == 0:  # a well-formed command on another verb's subject
            others = [s for v, s, _ in verbs if v != verb]
            subject_of = draw(st.sampled_from(others))
            expect = Expect.REJECTED  # its type is checked first, or its fields: either
        if version is Version.BAD and expect is not Expect.REJECTED:
            expect = Expect.BAD_REQUEST
        if version in (Version.NEWER, Version.REMOVED):  # first, on any coordinator subject
            expect = Expect.UNSUPPORTED if decodable else Expect.BAD_REQUEST
        if version is Version.ABSENT and expect is not Expect.REJECTED:  # its own verb's type
            expect = Expect.UNSUPPORTED if decodable else Expect.BAD_REQUEST
        return Request(
            label=f"{verb} {fields.get('type')} ({verdict.name}, {'json' if headers else 'mp'}"
            f"{', no version' if version is Version.ABSENT else f', version {number!r}'})",
            subject=subject_of(partition),
            payload=payload,
            headers=headers,
            expect=expect,
            command=fields,
        )

    return build()


def oneway_ends(partitions: int) -> st.SearchStrategy[Request]:
    """Ends published without a reply subject, valid or hostile, typed or raw bytes: none may
    be answered, and none may hurt the coordinator (it counts their errors)."""
    typed = st.one_of(end_commands(valid=True), drop_or_add_fields(end_commands()))

    @st.composite
    def build(draw: st.DrawFn) -> Request:
        version, number = draw(versions)
        command = typed
        if version is not Version.ABSENT:
            command = typed.map(lambda cv: ({**cv[0], "version": number}, cv[1]))
        payload, headers, fields, verdict = draw(encoded(command))
        if draw(st.integers(0, 5)) == 0:  # not even a command
            payload = draw(st.binary(max_size=64))
        txid = fields.get("txid")
        own = layout.partition_of(txid, partitions) if isinstance(txid, str) else 0
        partition = own if draw(st.integers(0, 3)) else draw(st.integers(0, partitions - 1))
        return Request(
            label=f"one-way end ({verdict.name}, version {version.value})",
            subject=end_on(partition),
            payload=payload,
            expect=Expect.NO_ANSWER,
            headers=headers,
            reply="",
            command=fields,
        )

    return build()


def _mistyped(item: Field, names: tuple[str, ...]) -> Field:
    """`item` with one of `names` of a type it never takes, or no map at all: refused alone
    (`bad_request`), as that item sent as a lone command would be."""

    @st.composite
    def build(draw: st.DrawFn) -> tuple[Any, Verdict]:
        fields, _ = draw(item)
        if draw(st.integers(0, 4)) == 0:
            return draw(wrong_types.filter(lambda v: not isinstance(v, dict))), Verdict.BAD
        return {**fields, draw(st.sampled_from(names)): draw(wrong_types)}, Verdict.BAD

    return build()


def prepare_items(max_payload: int, *, valid: bool = False) -> Field:
    """A `PrepareItem`: a Prepare's txid, messages and token, mostly well typed; one of the
    wrong type is refused alone."""
    item = combine(
        txid=names("txid", TXID_POOL, valid=True),
        messages=st.one_of(
            listed(outgoing(max_payload, valid=True), min_size=1, max_size=2),
            listed(outgoing(max_payload), min_size=1, max_size=2).filter(
                lambda mv: _well_typed(mv[0])
            ),
            bad(st.just([])),
        )
        if not valid
        else listed(outgoing(max_payload, valid=True), min_size=1, max_size=2),
        token=tokens(valid=True),
    )
    txid_grammar = bad(st.sampled_from(["a b", "", "x" * 200, "a.b"]))
    broken = st.tuples(item, txid_grammar).map(lambda t: ({**t[0][0], "txid": t[1][0]}, t[1][1]))
    mistyped = _mistyped(item, ("txid", "messages", "token"))
    return item if valid else st.one_of(item, item, broken, mistyped)


def end_items() -> Field:
    item = combine(
        txid=names("txid", TXID_POOL, valid=True),
        token=tokens(valid=True).filter(lambda tv: tv[0] is not None),
        decision=decisions(valid=True),
    )
    bad_token = bad(st.sampled_from(["NOT-A-TOKEN", HEX.upper() * 2, ""]))
    broken = st.tuples(item, bad_token).map(lambda t: ({**t[0][0], "token": t[1][0]}, t[1][1]))
    return st.one_of(item, item, broken, _mistyped(item, ("txid", "token", "decision")))


def batch_requests(partitions: int, max_payload: int) -> st.SearchStrategy[Request]:
    """`PrepareBatch` and `EndBatch` commands (docs/protocol.md#batches): items each owed
    what their lone command is, or the whole batch refused (version, group, size)."""

    @st.composite
    def build(draw: st.DrawFn) -> Request:
        verb = draw(st.sampled_from(["prepare", "end"]))
        count = draw(st.sampled_from([1, 2, 3, 4, 4, 0, MAX_BATCH_ITEMS + 1]))
        size = min(count, 4)
        drawn = [
            draw(prepare_items(max_payload) if verb == "prepare" else end_items())
            for _ in range(size)
        ]
        if count > size:  # past the limit: the same item again
            drawn += [drawn[-1]] * (count - size)
        items = [fields for fields, _ in drawn]
        txids = [i["txid"] for i in items if isinstance(i, dict) and isinstance(i["txid"], str)]
        partition = layout.partition_of(txids[0], partitions) if txids else 0
        if draw(st.integers(0, 4)) == 0:
            partition = draw(st.integers(0, partitions - 1))
        expects = []
        for fields, verdict in drawn:
            if verdict is Verdict.BAD:  # e.g. of the wrong type: no txid to route by
                expects.append(Expect.BAD_REQUEST)
                continue
            expect = _expect_for(verb, fields, verdict)
            if layout.partition_of(fields["txid"], partitions) != partition:
                expect = Expect.BAD_REQUEST
            expects.append(expect)
        command: dict[str, Any] = {"type": "PrepareBatch" if verb == "prepare" else "EndBatch"}
        whole: set[str] = set()  # what refuses the batch whole, for certain
        if verb == "prepare":
            group, group_verdict = draw(st.one_of(ok(st.just(GROUP)), names("group")))
            command |= {"group": group, "producer": "fzprod"}
            if group_verdict is Verdict.BAD:
                whole.add("bad_request")
            elif group != GROUP:
                whole.add("forbidden")
        command["items"] = items
        version, number = draw(versions)
        if version is not Version.ABSENT:
            command["version"] = number
        if not 1 <= count <= MAX_BATCH_ITEMS or number != BATCH_VERSION:
            whole.add("bad_request")
        payload, headers = msgspec.msgpack.encode(command), None
        if draw(st.booleans()):
            payload, headers = encode_json(command), dict(JSON)
        if version in (Version.NEWER, Version.REMOVED, Version.ABSENT):  # checked first
            decodable = _decodable(payload, headers is not None)
            whole = {"unsupported_version" if decodable else "bad_request"}
        # A value JSON cannot carry (a non-finite float) fails the whole batch's decoding;
        # any other bad item, one of the wrong type included, is refused alone.
        lenient = {"bad_request"} if headers and _mark_non_finite(items) != items else set()
        oneway = verb == "end" and draw(st.integers(0, 3)) == 0
        return Request(
            label=f"{command['type']} of {count} ({', '.join(e.name for e in expects)}; "
            f"{'whole: ' + '/'.join(sorted(whole)) if whole else 'items'}, "
            f"{'json' if headers else 'mp'}{', one-way' if oneway else ''}, version {number!r})",
            subject=(prepare_on if verb == "prepare" else end_on)(partition),
            payload=payload,
            expect=Expect.NO_ANSWER if oneway else Expect.ANSWER,
            headers=headers,
            reply="" if oneway else None,
            command=command,
            items=None if whole else tuple(expects),
            whole=frozenset(whole | lenient),
        )

    return build()


def raw_requests(partitions: int) -> st.SearchStrategy[Request]:
    """Bytes that are not a command: garbage, bad UTF-8, deep nesting, odd Content-Types."""
    subjects = st.sampled_from(
        [layout.admin_subject(p) for p in range(partitions)]
        + [
            f(p, group)  # any group token
            for p in range(partitions)
            for f in (layout.prepare_subject, layout.end_subject)
            for group in (GROUP, "fuzz", "other-group")
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
    """Any request, answered (it must not be) to a subject that is not an inbox; and a valid
    first prepare of a fresh txid so aimed, which must leave no transaction behind."""
    replies = st.sampled_from(hostile_replies(partitions, topic))
    inner = st.one_of(
        command_requests(partitions, max_payload),
        raw_requests(partitions),
        batch_requests(partitions, max_payload),
    )
    anything = st.builds(
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

    def unexecuted(suffix: str, reply: str) -> Request:
        txid = f"hr{suffix}"
        command = {
            "type": "Prepare",
            "version": PROTOCOL_VERSION,
            "txid": txid,
            "group": GROUP,
            "producer": "fzprod",
            "messages": [{"topic": "fz", "body": b"never"}],
        }
        return Request(
            f"reply={reply} on a valid prepare",
            prepare_on(layout.partition_of(txid, partitions)),
            msgspec.msgpack.encode(command),
            Expect.NO_ANSWER,
            reply=reply,
            command=command,
            never_prepared=txid,
        )

    valid = st.builds(unexecuted, st.text(HEX, min_size=12, max_size=12), replies)
    return st.one_of(anything, valid)


def flows(partitions: int, max_payload: int) -> st.SearchStrategy[Flow]:
    """Well-typed transactions with odd content, prepared on the txid's own partition."""
    typed = combine(
        group=ok(st.just(GROUP)),
        producer=ok(st.just("fzprod")),
        messages=st.one_of(
            listed(outgoing(max_payload, valid=True), min_size=1, max_size=2),
            listed(outgoing(max_payload), min_size=1, max_size=2),
        ),
    )

    @st.composite
    def build(draw: st.DrawFn) -> Flow:
        fields, verdict = draw(typed.filter(lambda cv: _well_typed(cv[0]["messages"])))
        txid = "fl" + draw(st.text("0123456789abcdef", min_size=12, max_size=12))
        decision = draw(st.sampled_from([*Decision, None]))
        oneway = decision is not None and draw(st.booleans())
        prepare = {"type": "Prepare", "version": PROTOCOL_VERSION, "txid": txid, **fields}
        return Flow(
            label=f"flow {decision and decision.value}{' one-way' if oneway else ''} "
            f"({verdict.name})",
            partition=layout.partition_of(txid, partitions),
            prepare=prepare,
            verdict=verdict,
            decision=decision,
            oneway=oneway,
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
    *MALFORMED_BLOCKS,
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
        [layout.admin_subject(p) for p in range(partitions)]
        + [
            f(p, group)  # any group token
            for p in range(partitions)
            for f in (layout.prepare_subject, layout.end_subject)
            for group in (GROUP, "fuzz", "other-group")
        ]
    )
    return st.builds(
        lambda s, h, b, a: RawFrame(
            f"raw header block {h!r}",
            s,
            h,
            b,
            a,
            Expect.ANSWER if b else Expect.BAD_REQUEST,  # no body: nothing to serve
        ),
        subjects,
        st.sampled_from(MALFORMED_HEADER_BLOCKS),
        st.sampled_from(
            [b"", msgspec.msgpack.encode({"type": "ListTransactions", "version": PROTOCOL_VERSION})]
        ),
        st.booleans(),
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
        batch_requests(partitions, max_payload),
        raw_requests(partitions),
        reply_injections(partitions, max_payload, topic),
        oneway_ends(partitions),
        flows(partitions, max_payload),
        flows(partitions, max_payload),
        raw_frames(partitions),
        check_answers,
    )


def batches(
    partitions: int, max_payload: int = DEFAULT_MAX_PAYLOAD, topic: str = "probe"
) -> st.SearchStrategy[list[FuzzInput]]:
    return st.lists(fuzz_inputs(partitions, max_payload, topic), min_size=1, max_size=6)
