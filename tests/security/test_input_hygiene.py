"""Input hygiene (issue 17): one set of validated scalars (gpuaas.contracts.scalars) in every service's API
schemas. Strict integers, ISO 4217 currencies, names without control/ANSI/bidi characters, bounded billing
periods: a refusal is 422 problem+json `validation_error` whose `errors[].type` names the rule. Defect 4:
`period=9999-12` on costs and statement close was a 500.

The unit tests check the types; the rest go through the gateway on a real stack, as the defects were found.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
from pydantic import BaseModel, Field, ValidationError

from gpuaas.billing.service.periods import parse_period
from gpuaas.contracts.scalars import BillingPeriod, CurrencyCode, Integer, Name, Text
from gpuaas.devstack.waiting import until_answered
from gpuaas.kit.errors import Problem

ANSI = "\x1b[31mred\x1b[0m"
BIDI = "invoice\u202egpj.exe"  # displays as "invoiceexe.jpg"


class _Body(BaseModel):
    name: Name = Field("", max_length=100)
    reason: Text = ""
    count: Integer | None = Field(None, ge=1, le=64)
    currency: CurrencyCode = "EUR"
    period: BillingPeriod = "2026-01"


def _types(raw: str) -> list[str]:
    try:
        _Body.model_validate_json(raw)
    except ValidationError as exc:
        return [e["type"] for e in exc.errors()]
    return []


@pytest.mark.parametrize(
    ("raw", "kind"),
    [
        ('{"count": "1"}', "int_type"),
        ('{"count": true}', "int_type"),
        ('{"count": 1.0}', "int_type"),
        ('{"name": "a\\u001b[31mb"}', "unsafe_characters"),
        ('{"name": "a\\u202eb"}', "unsafe_characters"),
        ('{"name": "a\\u2066b"}', "unsafe_characters"),
        ('{"name": "two\\nlines"}', "unsafe_characters"),
        ('{"name": "nul\\u0000"}', "unsafe_characters"),
        ('{"reason": "esc \\u001b[2J"}', "unsafe_characters"),
        ('{"currency": "XYZ"}', "unknown_currency"),
        ('{"currency": "eur"}', "string_pattern_mismatch"),
        ('{"period": "9999-12"}', "period_out_of_range"),
        ('{"period": "0000-01"}', "period_out_of_range"),
        ('{"period": "2026-13"}', "string_pattern_mismatch"),
    ],
)
def test_a_bad_scalar_is_refused_with_a_stable_type(raw: str, kind: str) -> None:
    assert _types(raw) == [kind]


def test_good_scalars_pass() -> None:
    body = _Body.model_validate_json(
        '{"name": "Ærøskøbing 東京 ✓", "reason": "line one\\n\\tline two", "count": 64, "currency": "JPY",'
        ' "period": "2199-12"}'
    )
    assert (body.count, body.currency, body.period) == (64, "JPY", "2199-12")


def test_the_period_parser_refuses_an_unbounded_year_itself() -> None:
    """Defence in depth: the use cases' own parser refuses what the API type refuses."""
    with pytest.raises(Problem) as caught:
        parse_period("9999-12")
    assert caught.value.status == 422 and caught.value.code == "period_out_of_range"
    assert parse_period("2026-02").month == 2


# ------------------------------------------------------------------------- through the gateway


def _refused(r: httpx.Response, kind: str, field: str) -> None:
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = r.json()
    assert body["code"] == "validation_error", body
    assert any(e["type"] == kind and e["loc"][-1] == field for e in body["errors"]), body


@pytest.mark.e2e
async def test_names_with_control_or_bidi_characters_are_refused(gw: httpx.AsyncClient) -> None:
    slug = f"hyg-{uuid.uuid4().hex[:6]}"
    for name in (ANSI, BIDI, "tab\there"):
        r = await gw.post("/api/identity/tenants", json={"slug": slug, "name": name})
        _refused(r, "unsafe_characters", "name")
    r = await gw.post("/api/identity/tenants", json={"slug": slug, "name": "Hygiene GmbH ✓"})
    assert r.status_code == 201, r.text
    tenant_id = r.json()["tenant_id"]
    r = await gw.post(f"/api/identity/tenants/{tenant_id}/projects", json={"name": BIDI})
    _refused(r, "unsafe_characters", "name")
    r = await gw.post(
        f"/api/identity/tenants/{tenant_id}/users",
        json={"email": f"u@{slug}.example.com", "password": "a long password 1", "display_name": ANSI},
    )
    _refused(r, "unsafe_characters", "display_name")


@pytest.mark.e2e
async def test_a_number_must_be_a_number(gw: httpx.AsyncClient) -> None:
    slug = f"num-{uuid.uuid4().hex[:6]}"
    tenant_id = (await gw.post("/api/identity/tenants", json={"slug": slug, "name": "Num"})).json()["tenant_id"]
    project_id = (await gw.post(f"/api/identity/tenants/{tenant_id}/projects", json={"name": "p"})).json()["project_id"]
    url = f"/api/allocations/projects/{project_id}/allocations"
    for count in ("1", True, 1.0):
        r = await gw.post(url, json={"gpu_model": "H100-80GB", "gpu_count": count})
        _refused(r, "int_type", "gpu_count")
    r = await gw.put(f"/api/allocations/projects/{project_id}/quota", json={"max_gpus": "8"})
    _refused(r, "int_type", "max_gpus")
    quota = f"/api/allocations/projects/{project_id}/quota"
    # The refusals above come before any lookup; a good body needs the project, which reaches allocations by event.
    await until_answered(gw, quota)
    r = await gw.put(quota, json={"max_gpus": 8})
    assert r.status_code == 200 and r.json()["max_gpus"] == 8, r.text


@pytest.mark.e2e
async def test_unknown_currencies_are_refused(gw: httpx.AsyncClient) -> None:
    slug = f"cur-{uuid.uuid4().hex[:6]}"
    tenant_id = (await gw.post("/api/identity/tenants", json={"slug": slug, "name": "Cur"})).json()["tenant_id"]
    budget = {"tenant_id": tenant_id, "limit_amount": "100", "name": "b"}
    r = await gw.post("/api/billing/budgets", json={**budget, "currency": "XYZ"})
    _refused(r, "unknown_currency", "currency")
    r = await gw.post("/api/billing/prices", json={"unit": "gpu_hour", "unit_price": "1.5", "currency": "ABC"})
    _refused(r, "unknown_currency", "currency")
    r = await gw.post("/api/billing/budgets", json={**budget, "currency": "EUR"})
    assert r.status_code == 201, r.text


@pytest.mark.e2e
async def test_a_far_future_period_is_a_4xx_not_a_500(gw: httpx.AsyncClient) -> None:
    """Defect 4: `period=9999-12` on costs and statement close was a 500 (year out of range)."""
    slug = f"per-{uuid.uuid4().hex[:6]}"
    tenant_id = (await gw.post("/api/identity/tenants", json={"slug": slug, "name": "Per"})).json()["tenant_id"]
    for period in ("9999-12", "0001-01"):
        r = await gw.get("/api/billing/costs", params={"tenant_id": tenant_id, "period": period})
        _refused(r, "period_out_of_range", "period")
        r = await gw.post("/api/billing/statements/close", json={"tenant_id": tenant_id, "period": period})
        _refused(r, "period_out_of_range", "period")
        r = await gw.get("/api/billing/budgets", params={"tenant_id": tenant_id, "period": period})
        _refused(r, "period_out_of_range", "period")
    r = await gw.get("/api/billing/costs", params={"tenant_id": tenant_id, "period": "2026-01"})
    assert r.status_code == 200, r.text
