"""Constrained scalar types shared by event payloads.

Why these exist: money and quantities must never pass through a float, times must never be
naive, and an artifact must always be named by its content digest (a tag can move). Encoding
those rules in the types means every producer and every consumer enforces them alike.

- `Money` / `Quantity`: `Decimal`, serialised in JSON as a plain decimal string ("0.000125",
  never "1.25E-4") so that consumers in any language parse it exactly.
- `Currency`: ISO 4217 code; every amount travels next to its currency.
- `Timestamp`: a timezone-aware datetime (naive datetimes are rejected).
- `Digest` / `PinnedRef`: content digests and `repo@sha256:…` references.

API inputs (request bodies and query parameters of every service):
- `Name` / `Text`: no control characters, ANSI escapes or bidi overrides (`Text` allows newline and tab).
- `Integer`: a strict JSON number (`"1"` and `true` refused).
- `CurrencyCode`: a code on the ISO 4217 list. `BillingPeriod`: `YYYY-MM` within a sane range of years.
"""

from __future__ import annotations

import unicodedata
from decimal import Decimal
from typing import Annotated

from pydantic import AfterValidator, AwareDatetime, Field, PlainSerializer, Strict
from pydantic.config import JsonDict
from pydantic_core import PydanticCustomError

DECIMAL_PATTERN = r"^-?[0-9]+(\.[0-9]+)?$"
NON_NEGATIVE_DECIMAL_PATTERN = r"^[0-9]+(\.[0-9]+)?$"
DIGEST_PATTERN = r"^(sha256:[0-9a-f]{64}|sha512:[0-9a-f]{128})$"
PINNED_REF_PATTERN = r"^[^@\s]+@(sha256:[0-9a-f]{64}|sha512:[0-9a-f]{128})$"


def _plain_decimal(value: Decimal) -> str:
    """Fixed-point text: `format(Decimal("1E+3"), "f") == "1000"`; keeps every digit."""
    return format(value, "f")


_DecimalText = PlainSerializer(_plain_decimal, return_type=str, when_used="json")
_DECIMAL_SCHEMA: JsonDict = {"format": "decimal", "pattern": DECIMAL_PATTERN}
_NON_NEGATIVE_DECIMAL_SCHEMA: JsonDict = {"format": "decimal", "pattern": NON_NEGATIVE_DECIMAL_PATTERN}

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


# ---------------------------------------------------------------------------------------- API input
# Validated scalars for request bodies and query parameters, shared by every service's API schemas so
# that one rule holds everywhere (not per-route checks). A refusal is a pydantic error with a stable
# `type` (`unsafe_characters`, `unknown_currency`, `period_out_of_range`), which the kit renders as 422
# problem+json `validation_error` with that type in `errors[].type`.

# Bidirectional-text controls (Trojan Source, CVE-2021-42574) and the line/paragraph separators: they make
# a name display as something other than what it is, or break a log line.
_BIDI_AND_SEPARATORS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u2028\u2029")


def _unsafe(value: str, allowed: frozenset[str]) -> str | None:
    for ch in value:
        if ch in allowed:
            continue
        # Cc: C0/C1 controls incl. ESC (ANSI escapes), DEL; Cs: lone surrogates; Cf bidi: see above
        if unicodedata.category(ch) in ("Cc", "Cs") or ch in _BIDI_AND_SEPARATORS:
            return f"U+{ord(ch):04X}"
    return None


def _single_line(value: str) -> str:
    if (bad := _unsafe(value, frozenset())) is not None:
        raise PydanticCustomError(
            "unsafe_characters",
            "must not contain control characters, ANSI escapes or bidirectional overrides (found {char})",
            {"char": bad},
        )
    return value


def _multi_line(value: str) -> str:
    if (bad := _unsafe(value, frozenset("\n\t"))) is not None:
        raise PydanticCustomError(
            "unsafe_characters",
            "must not contain control characters other than newline and tab, ANSI escapes or bidirectional "
            "overrides (found {char})",
            {"char": bad},
        )
    return value


Name = Annotated[str, AfterValidator(_single_line)]
"""A name or display name: one line, no control characters, ANSI escapes or bidi overrides (give
`min_length`/`max_length`/`pattern` with `Field` where it is used)."""

Text = Annotated[str, AfterValidator(_multi_line)]
"""Free text (a reason, a description, a message): like `Name`, but newlines and tabs are allowed."""

Integer = Annotated[int, Strict()]
"""A whole number that must arrive as a JSON number: `"1"`, `1.0` and `true` are refused (pydantic's lax
mode would take them as 1). Bounds with `Field(ge=, le=)` where it is used. Body fields only: a query
parameter arrives as text, so it keeps the plain `int`."""

# ISO 4217 active codes (list one, 2024), plus the precious metals and SDR the standard also defines. Kept
# in code (no dependency): a code is added here when the standard adds one.
_ISO_4217_CODES = """
    AED AFN ALL AMD ANG AOA ARS AUD AWG AZN BAM BBD BDT BGN BHD BIF BMD BND BOB BOV BRL BSD BTN BWP BYN
    BZD CAD CDF CHE CHF CHW CLF CLP CNY COP COU CRC CUC CUP CVE CZK DJF DKK DOP DZD EGP ERN ETB EUR FJD
    FKP GBP GEL GHS GIP GMD GNF GTQ GYD HKD HNL HTG HUF IDR ILS INR IQD IRR ISK JMD JOD JPY KES KGS KHR
    KMF KPW KRW KWD KYD KZT LAK LBP LKR LRD LSL LYD MAD MDL MGA MKD MMK MNT MOP MRU MUR MVR MWK MXN MXV
    MYR MZN NAD NGN NIO NOK NPR NZD OMR PAB PEN PGK PHP PKR PLN PYG QAR RON RSD RUB RWF SAR SBD SCR SDG
    SEK SGD SHP SLE SLL SOS SRD SSP STN SVC SYP SZL THB TJS TMT TND TOP TRY TTD TWD TZS UAH UGX USD USN
    UYI UYU UYW UZS VED VES VND VUV WST XAF XAG XAU XCD XCG XDR XOF XPD XPF XPT YER ZAR ZMW ZWG ZWL
"""
ISO_4217 = frozenset(_ISO_4217_CODES.split())


def _known_currency(value: str) -> str:
    if value not in ISO_4217:
        raise PydanticCustomError("unknown_currency", "{code} is not an ISO 4217 currency code", {"code": value})
    return value


CurrencyCode = Annotated[
    str,
    Field(pattern=r"^[A-Z]{3}$", description="ISO 4217 currency code (e.g. EUR, USD)"),
    AfterValidator(_known_currency),
]
"""An ISO 4217 currency code from the standard's list (an API input; events keep `Currency`, whose
values come from API inputs checked with this)."""

PERIOD_PATTERN = r"^\d{4}-(0[1-9]|1[0-2])$"
# Billing periods the platform can name: a year before any usage could exist is a typo, and one far in the
# future would overflow date arithmetic (9999-12 has no next month).
PERIOD_MIN_YEAR = 2000
PERIOD_MAX_YEAR = 2199


def _period_in_range(value: str) -> str:
    year = int(value[:4])
    if not PERIOD_MIN_YEAR <= year <= PERIOD_MAX_YEAR:
        raise PydanticCustomError(
            "period_out_of_range",
            "billing periods run from {low}-01 to {high}-12",
            {"low": PERIOD_MIN_YEAR, "high": PERIOD_MAX_YEAR},
        )
    return value


BillingPeriod = Annotated[
    str,
    Field(
        pattern=PERIOD_PATTERN,
        description=f"YYYY-MM (UTC calendar month), {PERIOD_MIN_YEAR}-01 to {PERIOD_MAX_YEAR}-12",
    ),
    AfterValidator(_period_in_range),
]
"""A billing period, "YYYY-MM", bounded to years PERIOD_MIN_YEAR..PERIOD_MAX_YEAR."""
