"""Constrained scalar types shared by event payloads.

Why these exist: money and quantities must never pass through a float, times must never be
naive, and an artifact must always be named by its content digest (a tag can move). Encoding
those rules in the types means every producer and every consumer enforces them alike.

- `Money` / `Quantity`: `Decimal`, serialised in JSON as a plain decimal string ("0.000125",
  never "1.25E-4") so that consumers in any language parse it exactly.
- `Currency`: ISO 4217 code; every amount travels next to its currency.
- `Timestamp`: a timezone-aware datetime (naive datetimes are rejected).
- `Digest` / `PinnedRef`: content digests and `repo@sha256:…` references.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated

from pydantic import AwareDatetime, Field, PlainSerializer

DECIMAL_PATTERN = r"^-?[0-9]+(\.[0-9]+)?$"
NON_NEGATIVE_DECIMAL_PATTERN = r"^[0-9]+(\.[0-9]+)?$"
DIGEST_PATTERN = r"^(sha256:[0-9a-f]{64}|sha512:[0-9a-f]{128})$"
PINNED_REF_PATTERN = r"^[^@\s]+@(sha256:[0-9a-f]{64}|sha512:[0-9a-f]{128})$"


def _plain_decimal(value: Decimal) -> str:
    """Fixed-point text: `format(Decimal("1E+3"), "f") == "1000"`; keeps every digit."""
    return format(value, "f")


_DecimalText = PlainSerializer(_plain_decimal, return_type=str, when_used="json")
_DECIMAL_SCHEMA = {"format": "decimal", "pattern": DECIMAL_PATTERN}
_NON_NEGATIVE_DECIMAL_SCHEMA = {"format": "decimal", "pattern": NON_NEGATIVE_DECIMAL_PATTERN}

Money = Annotated[
    Decimal,
    _DecimalText,
    Field(json_schema_extra=_DECIMAL_SCHEMA, description="decimal amount as a string; see `currency`"),
]
"""An amount of money (may be negative for credits); always paired with a `Currency` field."""

Quantity = Annotated[
    Decimal,
    Field(ge=0),
    _DecimalText,
    Field(json_schema_extra=_NON_NEGATIVE_DECIMAL_SCHEMA, description="non-negative decimal quantity as a string"),
]
"""A non-negative measured quantity (GPU-seconds, tokens, ...)."""

Currency = Annotated[str, Field(pattern=r"^[A-Z]{3}$", description="ISO 4217 currency code")]

Timestamp = AwareDatetime
"""A timezone-aware datetime; producers send UTC."""

Digest = Annotated[str, Field(pattern=DIGEST_PATTERN, description="content digest, e.g. sha256:<64 hex>")]

PinnedRef = Annotated[
    str,
    Field(pattern=PINNED_REF_PATTERN, description="reference pinned by digest: registry/repo@sha256:<64 hex>"),
]
