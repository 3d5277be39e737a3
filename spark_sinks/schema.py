"""From a topic's msgspec Struct to Spark columns, and from committed messages to Arrow batches.

The source hands Spark `pyarrow.RecordBatch`es built column by column, not Python tuples, so
Spark does no per-value conversion of its own (bench/HISTORY.md, "Spark sink backfill"). So
this module knows three things in one place: which Spark type each msgspec type becomes, how a
decoded value is turned into what pyarrow accepts for that type, and which metadata columns
every table has. A message whose payload does not decode (or does not fit its column) becomes
a *reject* row: metadata, the raw `payload` and the error text in `_error`, typed columns null.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import msgspec.inspect as mi
import pyarrow as pa  # type: ignore[import-untyped]
from pyspark.sql import types as T
from pyspark.sql.pandas.types import to_arrow_schema

from spark_sinks.errors import SchemaError
from txactors.wire import layout
from txactors.wire.protocol import payload_is_json

DECIMAL_PRECISION: Final = 38
DECIMAL_SCALE: Final = 18
"""msgspec's Decimal carries no precision; 38 digits with 18 after the point covers money and
most measurements. A value that does not fit is a reject, never silently rounded."""

PAYLOAD_COLUMN: Final = "payload"
ERROR_COLUMN: Final = "_error"

METADATA_FIELDS: Final = (
    T.StructField("topic", T.StringType(), False),
    T.StructField("stream_seq", T.LongType(), False),
    T.StructField("msg_id", T.StringType(), True),
    T.StructField("txid", T.StringType(), True),
    T.StructField("producer_group", T.StringType(), True),
    T.StructField("tag", T.StringType(), True),
    T.StructField("keys", T.ArrayType(T.StringType(), False), False),
    T.StructField("committed_at", T.TimestampType(), False),
    T.StructField("event_date", T.DateType(), False),
)
"""Columns every table has, from the headers of docs/protocol.md "Committed messages".
`event_date` is the UTC date of `committed_at`, the partition column next to `topic`."""

METADATA_NAMES: Final = frozenset(f.name for f in METADATA_FIELDS)

Converter = Callable[[Any], Any]
"""Turns one decoded value into what pyarrow accepts for the column's Arrow type."""


@dataclass(frozen=True, slots=True)
class Column:
    """One payload column: the Struct attribute it comes from and how its values convert."""

    name: str
    spark_type: T.DataType
    convert: Converter | None  # None: the decoded value is already what pyarrow wants


def struct_path(struct: type[msgspec.Struct]) -> str:
    """`module:QualName`: how a Struct travels in a data source option to the workers."""
    return f"{struct.__module__}:{struct.__qualname__}"


def load_struct(path: str) -> type[msgspec.Struct]:
    """Import the Struct named by `struct_path`; a clear error if it is not importable."""
    module_name, _, qualname = path.partition(":")
    if not module_name or not qualname:
        raise SchemaError(f"schema {path!r} must look like 'package.module:StructName'")
    try:
        found: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as exc:
        raise SchemaError(
            f"cannot import schema {path!r} ({exc}); the module must be importable where Spark "
            "runs (on a cluster: ship it with spark-submit --py-files)"
        ) from exc
    if not (isinstance(found, type) and issubclass(found, msgspec.Struct)):
        raise SchemaError(f"schema {path!r} is not a msgspec.Struct class")
    return found


def payload_columns(struct: type[msgspec.Struct]) -> list[Column]:
    """The typed columns for `struct`'s fields, in field order (SchemaError if one can't map)."""
    info = mi.type_info(struct)
    assert isinstance(info, mi.StructType)
    columns = []
    for field in info.fields:
        if field.name in METADATA_NAMES or field.name in (PAYLOAD_COLUMN, ERROR_COLUMN):
            raise SchemaError(
                f"{struct.__qualname__}.{field.name} has the name of a metadata column; "
                f"rename the field (metadata columns: {', '.join(sorted(METADATA_NAMES))})"
            )
        spark_type, convert = _map(field.type, f"{struct.__qualname__}.{field.name}")
        columns.append(Column(field.name, spark_type, convert))
    return columns


def spark_schema(struct: type[msgspec.Struct] | None) -> T.StructType:
    """The table's schema: metadata, then the payload's typed columns (or raw `payload`)."""
    fields = list(METADATA_FIELDS)
    if struct is not None:
        fields += [T.StructField(c.name, c.spark_type, True) for c in payload_columns(struct)]
    fields.append(T.StructField(PAYLOAD_COLUMN, T.BinaryType(), True))
    fields.append(T.StructField(ERROR_COLUMN, T.StringType(), True))
    return T.StructType(fields)


def _map(info: mi.Type, where: str) -> tuple[T.DataType, Converter | None]:
    """msgspec type → (Spark type, converter). Unsupported types fail with the field's path."""
    match info:
        case mi.BoolType():
            return T.BooleanType(), None
        case mi.IntType():
            return T.LongType(), None
        case mi.FloatType():
            return T.DoubleType(), None
        case mi.StrType():
            return T.StringType(), None
        case mi.BytesType() | mi.ByteArrayType() | mi.MemoryViewType():
            return T.BinaryType(), None if isinstance(info, mi.BytesType) else bytes
        case mi.DateTimeType():
            return T.TimestampType(), None  # naive datetimes are taken as UTC
        case mi.DateType():
            return T.DateType(), None
        case mi.DecimalType():
            return T.DecimalType(DECIMAL_PRECISION, DECIMAL_SCALE), None
        case mi.UUIDType():
            return T.StringType(), str
        case mi.EnumType():
            return _enum_type([m.value for m in info.cls], where), _enum_value
        case mi.LiteralType():
            return _enum_type(list(info.values), where), None
        case mi.UnionType() if info.includes_none and len(info.types) == 2:
            inner = next(t for t in info.types if not isinstance(t, mi.NoneType))
            spark_type, convert = _map(inner, where)
            return spark_type, None if convert is None else _optional(convert)
        case mi.ListType() | mi.SetType() | mi.FrozenSetType() | mi.VarTupleType():
            item_type, convert = _map(info.item_type, f"{where}[]")
            return T.ArrayType(item_type, True), _sequence(convert)
        case mi.DictType():
            key_type, key_convert = _map(info.key_type, f"{where}{{key}}")
            value_type, value_convert = _map(info.value_type, f"{where}{{value}}")
            return T.MapType(key_type, value_type, True), _mapping(key_convert, value_convert)
        case mi.StructType():
            return _struct(info, where)
        case _:
            raise SchemaError(
                f"{where}: msgspec type {type(info).__name__} has no Spark column type; use "
                "int, float, str, bool, bytes, datetime, date, Decimal, UUID, an Enum or "
                "Literal, Optional[...] of one, list/set/dict of them, or a nested Struct"
            )


def _enum_type(values: Sequence[object], where: str) -> T.DataType:
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return T.LongType()
    if all(isinstance(v, str) for v in values):
        return T.StringType()
    raise SchemaError(f"{where}: enum or literal values must be all str or all int")


def _enum_value(value: enum.Enum) -> object:
    return value.value  # what goes on the wire, so other languages' readers agree


def _optional(convert: Converter) -> Converter:
    return lambda v: None if v is None else convert(v)


def _sequence(convert: Converter | None) -> Converter:
    if convert is None:
        return list
    return lambda v: [None if x is None else convert(x) for x in v]


def _mapping(key: Converter | None, value: Converter | None) -> Converter:
    def convert(v: dict[Any, Any]) -> list[tuple[Any, Any]]:
        return [
            (k if key is None else key(k), x if value is None or x is None else value(x))
            for k, x in v.items()
        ]

    return convert


def _struct(info: mi.StructType, where: str) -> tuple[T.DataType, Converter]:
    parts = [(f.name, *_map(f.type, f"{where}.{f.name}")) for f in info.fields]
    spark_type = T.StructType([T.StructField(name, t, True) for name, t, _ in parts])

    def convert(v: msgspec.Struct) -> dict[str, Any]:
        out = {}
        for name, _, conv in parts:
            x = getattr(v, name)
            out[name] = x if conv is None or x is None else conv(x)
        return out

    return spark_type, convert


# -- decoding committed messages into Arrow batches -------------------------------------------

_MICROS_PER_DAY: Final = 86_400_000_000


@dataclass(frozen=True, slots=True)
class Committed:
    """One committed message as read from its topic stream.

    `published_us` is JetStream's store time, used for `committed_at` only when the
    `Txn-Committed-At` header is missing (a message not published by a coordinator).
    """

    seq: int
    published_us: int
    headers: dict[str, str]
    data: bytes


class BatchBuilder:
    """Builds the Arrow batches for one topic; created in the Python worker, used per chunk."""

    def __init__(self, topic: str, struct: type[msgspec.Struct] | None) -> None:
        self.topic = topic
        self.schema = spark_schema(struct)
        # Spark compares our batches with exactly this Arrow schema (UTC timestamps).
        self.arrow_schema = to_arrow_schema(self.schema, timezone="UTC")
        self._columns = payload_columns(struct) if struct is not None else []
        self._decoder = msgspec.msgpack.Decoder(struct) if struct is not None else None
        self._json_decoder = msgspec.json.Decoder(struct) if struct is not None else None

    def build(self, messages: Sequence[Committed]) -> pa.RecordBatch:
        """Metadata for every message; typed columns for those that decode, rejects for others."""
        typed: list[list[Any]] = [[] for _ in self._columns]
        payloads: list[bytes | None] = []
        errors: list[str | None] = []
        decoder, json_decoder = self._decoder, self._json_decoder
        pairs = [
            (values, column.name, column.convert)
            for values, column in zip(typed, self._columns, strict=True)
        ]
        for message in messages:
            if decoder is None or json_decoder is None:
                payloads.append(message.data)
                errors.append(None)
                continue
            try:  # JSON or msgpack, as a consumer decodes it (`payload_is_json`)
                if payload_is_json(message.headers):
                    obj = json_decoder.decode(message.data)
                else:
                    obj = decoder.decode(message.data)
            except (msgspec.DecodeError, ValueError) as exc:
                for values in typed:
                    values.append(None)
                payloads.append(message.data)
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            for values, name, convert in pairs:
                value = getattr(obj, name)
                values.append(value if convert is None or value is None else convert(value))
            payloads.append(None)
            errors.append(None)
        arrays = self._typed_arrays(typed, payloads, errors, messages)
        return pa.RecordBatch.from_arrays(
            [
                *self._metadata_arrays(messages),
                *arrays,
                pa.array(payloads, pa.binary()),
                pa.array(errors, pa.string()),
            ],
            schema=self.arrow_schema,
        )

    def _metadata_arrays(self, messages: Sequence[Committed]) -> list[pa.Array]:
        fields = self.arrow_schema
        committed = [_committed_us(m) for m in messages]
        headers = [m.headers for m in messages]
        return [
            pa.array([self.topic] * len(messages), pa.string()),
            pa.array([m.seq for m in messages], pa.int64()),
            pa.array([h.get(layout.MSG_ID_HEADER) for h in headers], pa.string()),
            pa.array([h.get(layout.TXID_HEADER) for h in headers], pa.string()),
            pa.array([h.get(layout.GROUP_HEADER) for h in headers], pa.string()),
            pa.array([h.get(layout.TAG_HEADER) for h in headers], pa.string()),
            pa.array([_keys(h) for h in headers], fields.field("keys").type),
            pa.array(committed, fields.field("committed_at").type),
            pa.array([us // _MICROS_PER_DAY for us in committed], pa.int32()).cast(pa.date32()),
        ]

    def _typed_arrays(
        self,
        typed: list[list[Any]],
        payloads: list[bytes | None],
        errors: list[str | None],
        messages: Sequence[Committed],
    ) -> list[pa.Array]:
        """Arrow arrays of the typed columns; a value that does not fit its column (a Decimal
        with too many digits, an int beyond 64 bits) turns its row into a reject."""
        offset = len(METADATA_FIELDS)
        types = [self.arrow_schema.field(offset + i).type for i in range(len(typed))]
        try:
            return [pa.array(values, t) for values, t in zip(typed, types, strict=True)]
        except (pa.ArrowException, OverflowError, TypeError, ValueError):
            pass
        for i, (values, arrow_type) in enumerate(zip(typed, types, strict=True)):
            for row, value in enumerate(values):
                if value is None:
                    continue
                try:
                    pa.array([value], arrow_type)
                except (pa.ArrowException, OverflowError, TypeError, ValueError) as exc:
                    errors[row] = f"{self._columns[i].name}: does not fit {arrow_type}: {exc}"
                    payloads[row] = messages[row].data
                    for column in typed:
                        column[row] = None
        return [pa.array(values, t) for values, t in zip(typed, types, strict=True)]


def _committed_us(message: Committed) -> int:
    stamp = message.headers.get(layout.COMMITTED_AT_HEADER)
    if stamp is None:
        return message.published_us
    try:
        return round(float(stamp) * 1_000_000)
    except ValueError:
        return message.published_us


def _keys(headers: dict[str, str]) -> list[str]:
    keys = headers.get(layout.KEYS_HEADER)
    return keys.split(",") if keys else []
