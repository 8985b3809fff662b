"""Opaque credentials (refresh tokens, login codes, client secrets): made random, stored only as hashes."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_secret(prefix: str) -> str:
    return f"{prefix}_{secrets.token_urlsafe(32)}"


def now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class Client:
    """Where a login comes from (recorded on the session, used for per-source throttling)."""

    ip: str = "unknown"
    user_agent: str | None = None
