"""Catalog's busiest flow, driven through the gateway as the platform admin: artifact promotion.

Each of `n` blob artifacts (raw blobs pushed to a real OCI registry on loopback: the catalog verifies
every digest against it) goes, concurrently with the others: register (draft) → an app manifest for it
(inactive) → lint and smoke results recorded → staged → canary (exposed to one tenant) → active → the
manifest activated. Transitions carry `If-Match` with the version the client last saw. Requests that
meet the fault (502/503/504, a dropped connection, 409 in progress) are retried with the same
Idempotency-Key (`workload.call`).

A request whose effect committed but whose process died before its response was stored holds an
Idempotency-Key reservation with no response; the retry runs it again once the reservation is stale.
Catalog's use cases refuse or absorb that second run (the state machine, the unique ref and slug+version,
`If-Match`, a check result recorded again is the same record); the client then re-reads, as any client
would, and the workload counts it in `reran`.

Invariants (`check_promotions`): every artifact is active with its manifest active; catalog's transition
table holds exactly draft, staged, canary, active once per artifact; catalog's outbox holds exactly one
audit event per mutation (no duplicate, none lost) and every row was sent; identity's audit store holds
exactly those events, once each; app-runtime's catalog projection holds each manifest once, in its final
state, and its inbox took each manifest event once; nothing is parked in any service's dead letters.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from gpuaas.catalog.oci import RegistryClient
from gpuaas.devstack.registry import LocalRegistry
from gpuaas.devstack.stack import SERVICES, Stack
from gpuaas.devstack.waiting import eventually

from .workload import call, response_lost

API = "/api/catalog"
# The API steps of one artifact's promotion, in order (pushing the blob to the registry is not one).
STEPS = ("register", "manifest", "lint", "smoke", "staged", "canary", "active", "activate")
TRANSITIONS = [(None, "draft"), ("draft", "staged"), ("staged", "canary"), ("canary", "active")]
ARTIFACT_ACTIONS = ["catalog.artifact.register", "catalog.artifact.check.lint", "catalog.artifact.check.smoke"] + [
    f"catalog.artifact.{to}" for to in ("staged", "canary", "active")
]
MANIFEST_ACTIONS = ["catalog.app.register", "catalog.app.activate"]


@dataclass
class Promotion:
    stack: Stack
    gw: httpx.AsyncClient  # the platform admin
    registry: LocalRegistry
    n: int = 6
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    tenant: str = ""
    items: list[dict[str, Any]] = field(default_factory=list)
    retries: dict[str, int] = field(default_factory=dict)
    reran: dict[str, int] = field(default_factory=dict)
    steps_done: int = 0
    midway: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def kill_after(self) -> int:
        """Steps done when the fault should strike: a third of the way, most of the flow still ahead."""
        return self.n * len(STEPS) // 3

    async def setup(self) -> None:
        r = await call(
            self.gw, "POST", "/api/identity/tenants", json={"slug": f"fc-{self.run}", "name": "Canary"}, ok=(201,)
        )
        self.tenant = r.json()["tenant_id"]

        async def known() -> bool:  # canary exposure needs the tenant in catalog's identity projection
            sql = "SELECT count(*) FROM iam_tenants WHERE tenant_id = $1"
            return await self.stack.fetchval("catalog", sql, uuid.UUID(self.tenant)) == 1

        await eventually(known, 60, "the canary tenant in catalog's projection")

    async def promote_all(self) -> None:
        oci = RegistryClient(["127.0.0.1"], timeout_s=10)
        refs = []
        for i in range(self.n):  # the registry is not under test: push first, promote concurrently
            data = f"faults {self.run} artifact {i}\n".encode() + os.urandom(32)
            digest = await oci.push_blob(self.registry.address, f"faults/{self.run}", data)
            refs.append(f"{self.registry.address}/faults/{self.run}@{digest}")
        await asyncio.gather(*[self.promote(i, ref) for i, ref in enumerate(refs)])

    async def promote(self, i: int, ref: str) -> None:
        item: dict[str, Any] = {"ref": ref, "slug": f"fc-{self.run}-{i}"}
        self.items.append(item)
        art = await self._step(
            "register",
            "POST",
            f"{API}/artifacts",
            json={"ref": ref, "kind": "blob"},
            ok=201,
            already=("artifact_already_registered",),
            reread=lambda: self._artifact_by_ref(ref),
        )
        aid = item["artifact_id"] = art["artifact_id"]
        body = {"slug": item["slug"], "display_name": f"Fault {i}", "version": "1.0.0", "artifact_kind": "blob"}
        manifest = await self._step(
            "manifest",
            "POST",
            f"{API}/apps",
            json={**body, "artifact_ref": ref},
            ok=201,
            already=("manifest_version_exists",),
            reread=lambda: self._manifest_by_slug(item["slug"]),
        )
        item["manifest_id"] = manifest["manifest_id"]
        for name in ("lint", "smoke"):
            art = await self._step(
                name,
                "POST",
                f"{API}/artifacts/{aid}/checks",
                json={"name": name, "passed": True, "detail": f"{name} passed (run {self.run}, artifact {i})"},
                ok=200,
                reread=lambda name=name: self._artifact_with_check(aid, name),
            )
        for to in ("staged", "canary", "active"):
            art = await self._step(
                to,
                "POST",
                f"{API}/artifacts/{aid}/transitions",
                json={"to": to, "reason": f"fault run {self.run}", "canary_tenants": [self.tenant]},
                headers={"If-Match": f'"{art["version"]}"'},
                ok=200,
                already=("version_mismatch",),
                reread=lambda to=to: self._artifact_in(aid, to),
            )
        mid = item["manifest_id"]
        await self._step(
            "activate",
            "POST",
            f"{API}/manifests/{mid}/activate",
            json={"reason": "promoted"},
            ok=200,
            reread=lambda: self._manifest_active(mid),
        )

    async def _step(
        self,
        what: str,
        method: str,
        url: str,
        *,
        ok: int,
        already: tuple[str, ...] = (),
        reread: Callable[[], Awaitable[dict[str, Any]]] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """One logical request. A refusal in `already` is accepted only after a retry (the first run's effect
        committed, its response died with the process) and only if re-reading shows the effect."""
        stats: dict[str, int] = {}
        r = await call(self.gw, method, url, ok=(ok, 409, 412) if already else (ok,), stats=stats, **kwargs)
        for k, v in stats.items():
            self.retries[k] = self.retries.get(k, 0) + v
        if r.status_code == ok:
            body: dict[str, Any] = r.json()
        else:
            code = r.json().get("code")
            rerun_refused = bool(stats) and code in already  # ran again after a stale reservation: refused
            assert (rerun_refused or response_lost(r)) and reread is not None, f"{what}: {r.status_code} {r.text[:300]}"
            body = await reread()
            key = f"{what} (response lost)" if response_lost(r) else what
            self.reran[key] = self.reran.get(key, 0) + 1
        self.steps_done += 1
        if self.steps_done >= self.kill_after:
            self.midway.set()
        return body

    async def _artifact_by_ref(self, ref: str) -> dict[str, Any]:
        r = await call(self.gw, "GET", f"{API}/artifacts", params={"kind": "blob", "limit": 1000}, ok=(200,))
        found = [a for a in r.json() if a["ref"] == ref]
        assert len(found) == 1, f"{ref}: {len(found)} artifacts"
        return found[0]

    async def _manifest_by_slug(self, slug: str) -> dict[str, Any]:
        r = await call(self.gw, "GET", f"{API}/apps/{slug}", ok=(200,))
        assert len(r.json()) == 1, r.json()
        return r.json()[0]

    async def _artifact_with_check(self, aid: str, name: str) -> dict[str, Any]:
        r = await call(self.gw, "GET", f"{API}/artifacts/{aid}", ok=(200,))
        assert any(c["name"] == name and c["passed"] for c in r.json()["checks"]), r.json()["checks"]
        return r.json()

    async def _manifest_active(self, mid: str) -> dict[str, Any]:
        r = await call(self.gw, "GET", f"{API}/manifests/{mid}", ok=(200,))
        assert r.json()["active"] is True, r.json()
        return r.json()

    async def _artifact_in(self, aid: str, state: str) -> dict[str, Any]:
        r = await call(self.gw, "GET", f"{API}/artifacts/{aid}", ok=(200,))
        assert r.json()["state"] == state, f"{aid} is {r.json()['state']}, not {state}"
        return r.json()


# -------------------------------------------------------------------------------------------- invariants


async def _outbox(stack: Stack, svc: str, ids: list[str], *event_types: str) -> list[Any]:
    """The service's outbox events of these aggregates, with their `data` decoded."""
    rows = await stack.fetch(
        svc,
        "SELECT event_id, aggregate_id, convert_from(payload, 'UTF8') AS payload FROM outbox "
        "WHERE aggregate_id = ANY($1) AND event_type = ANY($2)",
        ids,
        list(event_types),
    )
    return [{**dict(r), "data": json.loads(r["payload"])["data"]} for r in rows]


async def check_promotions(p: Promotion, timeout_s: float = 120.0) -> dict[str, Any]:
    stack = p.stack
    assert len(p.items) == p.n and all("manifest_id" in i for i in p.items), p.items
    artifact_ids = [i["artifact_id"] for i in p.items]
    manifest_ids = [i["manifest_id"] for i in p.items]
    for item in p.items:
        a = (await call(p.gw, "GET", f"{API}/artifacts/{item['artifact_id']}", ok=(200,))).json()
        m = (await call(p.gw, "GET", f"{API}/manifests/{item['manifest_id']}", ok=(200,))).json()
        assert a["state"] == "active" and m["active"] is True and m["artifact_state"] == "active", (a, m)
        assert {c["name"] for c in a["checks"] if c["passed"]} >= {"lint", "smoke", "content"}, a["checks"]

    # Catalog's own history: one row per move, none twice, none missing.
    rows = await stack.fetch(
        "catalog",
        "SELECT artifact_id::text AS aid, from_state, to_state FROM artifact_transitions "
        "WHERE artifact_id = ANY($1) ORDER BY occurred_at, transition_id",
        [uuid.UUID(a) for a in artifact_ids],
    )
    history: dict[str, list[tuple[str | None, str]]] = {a: [] for a in artifact_ids}
    for r in rows:
        history[r["aid"]].append((r["from_state"], r["to_state"]))
    assert all(h == TRANSITIONS for h in history.values()), history

    # Catalog's outbox: exactly one audit event per mutation, and every row sent.
    audits = await _outbox(stack, "catalog", artifact_ids + manifest_ids, "audit.recorded")
    actions: dict[tuple[str, str], int] = {}
    for r in audits:
        key = (r["aggregate_id"], r["data"]["action"])
        actions[key] = actions.get(key, 0) + 1
    expected = {(a, act): 1 for a in artifact_ids for act in ARTIFACT_ACTIONS}
    expected |= {(m, act): 1 for m in manifest_ids for act in MANIFEST_ACTIONS}
    assert actions == expected, {k: v for k, v in actions.items() if expected.get(k) != v} or set(expected) - set(
        actions
    )

    async def all_sent() -> bool:
        sql = "SELECT count(*) FROM outbox WHERE aggregate_id = ANY($1) AND sent_at IS NULL"
        return await stack.fetchval("catalog", sql, artifact_ids + manifest_ids) == 0

    await eventually(all_sent, timeout_s, "catalog's outbox rows all sent")

    # Identity's audit store: exactly the events catalog emitted, once each.
    audit_ids = {r["event_id"] for r in audits}

    async def stored() -> list[Any]:
        rows = await stack.fetch(
            "identity",
            "SELECT event_id, resource_id, action FROM audit_records WHERE resource_id = ANY($1)",
            artifact_ids + manifest_ids,
        )
        return rows if {r["event_id"] for r in rows} >= audit_ids else []

    stored_rows = await eventually(stored, timeout_s, "identity's audit records of every catalog mutation")
    assert sorted(r["event_id"] for r in stored_rows) == sorted(audit_ids), "an audit record stored twice or foreign"

    # App-runtime's catalog projection: each manifest once, in its final state; each manifest event applied once.
    manifest_events = await _outbox(stack, "catalog", manifest_ids, "app.registered", "app.updated")
    assert len(manifest_events) == 2 * p.n, len(manifest_events)  # registered, then activated
    final: dict[str, int] = {}
    for r in manifest_events:
        final[r["aggregate_id"]] = max(final.get(r["aggregate_id"], 0), r["data"]["revision"])

    async def projected() -> bool:
        rows = await stack.fetch(
            "app_runtime",
            "SELECT manifest_id::text AS mid, active, revision FROM manifests WHERE manifest_id = ANY($1)",
            [uuid.UUID(m) for m in manifest_ids],
        )
        return len(rows) == p.n and all(r["active"] and r["revision"] == final[r["mid"]] for r in rows)

    await eventually(projected, timeout_s, "app-runtime's projection of every manifest, active")
    applied = await stack.fetch(
        "app_runtime",
        "SELECT event_id, count(*) AS n FROM inbox WHERE event_id = ANY($1) GROUP BY event_id",
        [r["event_id"] for r in manifest_events],
    )
    assert len(applied) == len(manifest_events) and all(r["n"] == 1 for r in applied), [dict(r) for r in applied]

    parked = {
        svc: await stack.fetchval(svc, "SELECT count(*) FROM dead_letters WHERE status = 'parked'") for svc in SERVICES
    }
    assert not any(parked.values()), parked
    return {
        "artifacts": p.n,
        "transitions": len(rows),
        "audit_records": len(audit_ids),
        "manifest_events": len(manifest_events),
        "retried": dict(p.retries),
        "reran": dict(p.reran),
    }
