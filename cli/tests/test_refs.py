"""Names and short ids where commands take ids (issue 21): the resolution order (full id, exact name,
unique id prefix), the errors that list the candidates, short ids that stay unique for UUIDv7 ids made in
the same minute, and money that always carries its currency."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import pytest

from gpuaas.cli.output import money
from gpuaas.cli.refs import Unresolved, resolve, short_ids


@dataclass
class Thing:
    id: str
    name: str


# UUIDv7-like: the same first 12 hex characters (one millisecond), then different random bits.
A = Thing("019ab8c4-1f2e-7a01-8000-000000000001", "cli-test")
B = Thing("019ab8c4-1f2e-7b02-8000-000000000002", "worker")
C = Thing("019ab8c4-1f2e-7b03-8000-000000000003", "worker")
D = Thing("11111111-2222-7333-8444-555555555555", "019ab8c4")  # a name that looks like a prefix
ITEMS = [A, B, C, D]


def pick(ref: str) -> Thing:
    return resolve("allocation", ref, ITEMS, id_of=lambda t: t.id, names=lambda t: (t.name,))


def test_full_id_then_name_then_unique_prefix() -> None:
    assert pick(A.id) is A
    assert pick(A.id.upper()) is A  # a UUID in any spelling
    assert pick("cli-test") is A
    assert pick("019ab8c4") is D  # an exact name wins over an id prefix (as docker does)
    assert pick("019ab8c41f2e7a") is A  # dashes are optional in a prefix
    assert pick("019ab8c4-1f2e-7a") is A
    assert pick("1111") is D


def test_ambiguity_and_absence_are_errors_that_say_what_fits() -> None:
    with pytest.raises(Unresolved) as e:
        pick("worker")
    assert e.value.code == "ambiguous_reference"
    assert "fits 2 allocations" in e.value.detail and "worker" in e.value.detail
    shorts = short_ids([B.id, C.id])
    assert shorts[B.id] in e.value.detail and shorts[C.id] in e.value.detail
    with pytest.raises(Unresolved) as e:
        pick("019ab8c4-1f2e-7b")
    assert e.value.code == "ambiguous_reference" and "id prefix" in e.value.detail
    with pytest.raises(Unresolved) as e:
        pick("nope")
    assert e.value.code == "not_found" and "'nope'" in e.value.detail
    with pytest.raises(Unresolved) as e:
        pick(str(uuid.uuid4()).replace("-", "")[:6] + "zz")
    assert e.value.code == "not_found"


def test_emails_match_in_any_case() -> None:
    people = [Thing("aaaaaaaa-0000-7000-8000-000000000001", "Bob@Example.com")]
    assert resolve("member", "bob@example.com", people, id_of=lambda t: t.id, names=lambda t: (t.name,)) is people[0]


def test_short_ids_are_unique_prefixes_the_resolver_accepts() -> None:
    shorts = short_ids(t.id for t in ITEMS)
    assert len(set(shorts.values())) == len(ITEMS)
    assert shorts[D.id] == "11111111"  # 8 characters when that is enough
    assert all(len(s) >= 8 and not s.endswith("-") for s in shorts.values())
    for t in (A, B, C):  # the shared millisecond makes them longer, until they differ
        assert len(shorts[t.id]) > 14
        assert resolve("x", shorts[t.id], [A, B, C], id_of=lambda t: t.id, names=lambda t: ()) is t
    assert short_ids([]) == {}
    # Real UUIDv7-shaped ids from one instant: still unique, still resolvable.
    base = "019ab8c4-1f2e-7"
    many = [f"{base}{i:03x}-8000-{uuid.uuid4().hex[:12]}" for i in range(50)]
    s = short_ids(many)
    assert len(set(s.values())) == 50
    assert all(resolve("x", s[i], many, id_of=lambda t: t, names=lambda t: ()) == i for i in many)


def test_money_always_has_its_currency() -> None:
    assert money("0", "USD") == "0.00 USD"
    assert money("5.000000", "EUR") == "5.00 EUR"
    assert money("0.000702", "USD") == "0.000702 USD"
    assert money("12.5", "USD") == "12.50 USD"
    assert money("1E+2", "USD") == "100.00 USD"
