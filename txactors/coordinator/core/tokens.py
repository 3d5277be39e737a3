"""Commit tokens: handed to the producer once, kept by the coordinator only as a digest.

A token proves that an `end` (or a later prepare) comes from whoever began the transaction.
TXN_HALF is readable by anyone with stream access, so it stores `sha256:<hex>` of the token,
never the token; the table compares digests in constant time. (Halves written before tokens
were hashed hold the raw token; reading them as its digest was removed in 0.x, so no token
matches such a half and its check-back settles it.)
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from typing import Final

TOKEN_BYTES: Final = 16
TOKEN_PATTERN: Final = re.compile(r"[0-9a-f]{32}")
"""A token on the wire: 128 random bits as 32 lowercase hex digits."""
_DIGEST_PREFIX: Final = "sha256:"


def new_token() -> str:
    return secrets.token_hex(TOKEN_BYTES)


def digest(token: str) -> str:
    """What the coordinator stores and compares in place of `token`."""
    return _DIGEST_PREFIX + hashlib.sha256(token.encode()).hexdigest()


def same(stored: str, presented: str) -> bool:
    """Two digests are equal, compared in constant time."""
    return hmac.compare_digest(stored.encode(), presented.encode())
