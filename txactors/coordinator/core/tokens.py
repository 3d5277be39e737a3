"""Commit tokens: handed to the producer once, kept by the coordinator only as a digest.

A token proves that an `end` (or a later prepare) comes from whoever began the transaction.
TXN_HALF is readable by anyone with stream access, so it stores a digest of the token, never
the token: the first 128 bits of its SHA-256 (as many as the token has), base64url without
padding, 22 characters on every half. The table compares digests in constant time. Halves
an earlier 0.x wrote hold `sha256:<hex>`, the whole digest: `stored_digest` reads that as
today's form, so their ends still match. (Halves written before tokens were hashed
hold the raw token; no token matches such a half and its check-back settles it.)
"""

from __future__ import annotations

import binascii
import hashlib
import hmac
import os
import re
from typing import Final

TOKEN_BYTES: Final = 16
TOKEN_PATTERN: Final = re.compile(r"[0-9a-f]{32}")
"""A token on the wire: 128 random bits as 32 lowercase hex digits."""
DIGEST_BYTES: Final = 16
"""Bytes of SHA-256 kept: a digest as long as the token cannot be found from it faster than the
token can be guessed."""
_OLD_DIGEST_PREFIX: Final = "sha256:"


def new_tokens(count: int) -> list[str]:
    """`count` tokens from one draw of the OS's randomness (a draw each cost a system call
    per prepare): each is `TOKEN_BYTES` random bytes of its own, as hex."""
    digits = os.urandom(TOKEN_BYTES * count).hex()
    width = 2 * TOKEN_BYTES
    return [digits[i : i + width] for i in range(0, len(digits), width)]


def digest(token: str) -> str:
    """What the coordinator stores and compares in place of `token`."""
    return _text(hashlib.sha256(token.encode()).digest())


def stored_digest(stored: str) -> str:
    """A digest as read from a half, in today's form: an old `sha256:<hex>` becomes its first
    `DIGEST_BYTES`; anything else (today's form, a raw token of long ago) is kept as is."""
    if stored.startswith(_OLD_DIGEST_PREFIX):
        return _text(bytes.fromhex(stored.removeprefix(_OLD_DIGEST_PREFIX)))
    return stored


_URLSAFE: Final = bytes.maketrans(b"+/", b"-_")


def _text(sha256: bytes) -> str:
    """`base64.urlsafe_b64encode` without its padding, in C (that one is two Python calls;
    two digests a transaction)."""
    encoded = binascii.b2a_base64(sha256[:DIGEST_BYTES], newline=False)
    return encoded.translate(_URLSAFE).rstrip(b"=").decode()


def same(stored: str, presented: str) -> bool:
    """Two digests are equal, compared in constant time."""
    return hmac.compare_digest(stored.encode(), presented.encode())
