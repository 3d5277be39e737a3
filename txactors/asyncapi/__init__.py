"""The wire protocol as an AsyncAPI 3.0 document, generated from the code that speaks it.

The payload schemas are msgspec's JSON Schemas of the Structs in `protocol.py`; the subjects
and header names come from `layout.py`; the limits the coordinator enforces
(`coordinator/boundary.py`) are added to the schemas as patterns, lengths and ranges. So the
document cannot drift from the code: `docs/asyncapi.json` is this package's output
(`txactors protocol asyncapi -o docs/asyncapi.json`), and tests/integration/test_asyncapi.py fails
when the
checked-in copy differs from a fresh one. What a schema cannot say (the check-back's encoding,
base64 in JSON, id ranges, which errors are retriable) is in docs/protocol.md.

The operations are a client's: a producer *sends* prepares and ends and *receives* check-backs,
a consumer *receives* committed messages, an operator *sends* admin commands.
"""

from txactors.asyncapi.document import ASYNCAPI_VERSION, OUTPUT, REGENERATE, document, render
from txactors.asyncapi.headers import INTERNAL_HEADERS, header_schemas
from txactors.asyncapi.schemas import (
    KEY_PATTERN,
    NAME_PATTERN,
    VALUE_PATTERN,
    name_schema,
    payload_schemas,
)

__all__ = [
    "ASYNCAPI_VERSION",
    "INTERNAL_HEADERS",
    "KEY_PATTERN",
    "NAME_PATTERN",
    "OUTPUT",
    "REGENERATE",
    "VALUE_PATTERN",
    "document",
    "header_schemas",
    "name_schema",
    "payload_schemas",
    "render",
]
