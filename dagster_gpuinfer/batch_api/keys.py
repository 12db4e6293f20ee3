"""API keys: `sk-gpi-<key id>.<secret>`, stored as a salted SHA-256 of the secret.

The secret is 32 random bytes (`secrets.token_urlsafe`), not a password a person chose, so
a slow hash (scrypt) adds nothing against guessing: 256 bits cannot be searched. A salted
SHA-256 keeps a stolen table useless and costs microseconds per request, where scrypt would
cost tens of milliseconds on every poll. The key id (public) finds the row; the comparison
is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

KEY_PREFIX = "sk-gpi-"


@dataclass(frozen=True)
class NewKey:
    """A key as created: `token` is shown once and never stored."""

    key_id: str
    token: str
    salt: str
    digest: str


def hash_secret(secret: str, salt: str) -> str:
    return hashlib.sha256(f"{salt}:{secret}".encode()).hexdigest()


def new_key() -> NewKey:
    key_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    salt = secrets.token_hex(16)
    return NewKey(
        key_id=key_id,
        token=f"{KEY_PREFIX}{key_id}.{secret}",
        salt=salt,
        digest=hash_secret(secret, salt),
    )


def split_token(token: str) -> tuple[str, str] | None:
    """`(key id, secret)` of a well-formed token, else None."""
    if not token.startswith(KEY_PREFIX):
        return None
    key_id, dot, secret = token[len(KEY_PREFIX) :].partition(".")
    if not dot or not key_id or not secret:
        return None
    return key_id, secret


def secret_matches(secret: str, salt: str, digest: str) -> bool:
    return hmac.compare_digest(hash_secret(secret, salt), digest)
