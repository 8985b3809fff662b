"""Issue 28: domain proofs never expired — a domain proven once by its TXT record stayed the tenant's for
ever (enforced SSO, discovery, linking), even after the domain changed hands and the record was gone.
Now identity looks the record up again once a proof is `domain_reverify_after_s` old: still there, the
proof is renewed; gone, the domain is unverified (audited `identity.idp.domain_unverified`).

identity runs in process (real Postgres, real broker) with its background loop on a short period and the
test's DNS server (dnspython over UDP on loopback) as the operator's resolver, as the other domain-proof
tests do.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import dns.asyncresolver
import dns.nameserver
import pytest

from gpuaas.identity.credentials import now
from gpuaas.identity.runtime import IdentityRuntime
from gpuaas.identity.settings import Settings

from .federation_support import IdentityUnderTest, LoopbackDns, identity_app

REVERIFY_AFTER_S = 1


@dataclass
class World:
    identity: IdentityUnderTest
    dns: LoopbackDns


@pytest.fixture(scope="module")
async def world(infra) -> AsyncIterator[World]:
    dns_server = LoopbackDns().start()
    try:
        async with identity_app(
            infra.admin_url,
            infra.kafka_bootstrap,
            dns_nameservers=[dns_server.nameserver],
            domain_reverify_after_s=REVERIFY_AFTER_S,
            domain_reverify_every_s=0.2,
        ) as identity:
            yield World(identity, dns_server)
    finally:
        dns_server.stop()


@pytest.fixture(scope="module")
async def quiet(infra) -> AsyncIterator[World]:
    """identity with its loop off: the test runs the re-verification itself, at the time it names."""
    dns_server = LoopbackDns().start()
    try:
        async with identity_app(
            infra.admin_url, infra.kafka_bootstrap, dns_nameservers=[dns_server.nameserver], domain_reverify_every_s=0
        ) as identity:
            yield World(identity, dns_server)
    finally:
        dns_server.stop()


async def until(probe: Callable[[], Awaitable[Any]], what: str, timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        if got := await probe():
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def proven_domain(w: World, **idp: Any) -> tuple[dict[str, Any], str, str]:
    """A tenant whose IdP owns a fresh domain, proven by its TXT record: (tenant, idp_id, domain)."""
    t = await w.identity.tenant()
    domain = f"reverify-{uuid.uuid4().hex[:6]}.example"
    r = await w.identity.client.post(
        f"/tenants/{t['tenant_id']}/identity-providers",
        json={"name": "idp", "issuer": "https://idp.example.com", "client_id": "c", "domains": [domain], **idp},
        headers=t["admin"],
    )
    assert r.status_code == 201, r.text
    idp_id = r.json()["idp_id"]
    w.dns.set(f"_gpuaas-challenge.{domain}", "TXT", r.json()["domain_claims"][0]["challenge_value"])
    r = await w.identity.client.post(
        f"/tenants/{t['tenant_id']}/identity-providers/{idp_id}/domains/{domain}/verify", headers=t["admin"]
    )
    assert r.status_code == 200 and r.json()["verified"] is True, r.text
    return t, idp_id, domain


async def claim_of(w: World, t: dict[str, Any], idp_id: str, domain: str) -> dict[str, Any]:
    r = await w.identity.client.get(f"/tenants/{t['tenant_id']}/identity-providers", headers=t["admin"])
    assert r.status_code == 200, r.text
    idp = next(i for i in r.json() if i["idp_id"] == idp_id)
    return dict(next(c for c in idp["domain_claims"] if c["domain"] == domain))


async def account_type(w: World, email: str) -> str:
    r = await w.identity.client.get("/auth/discover", params={"email": email})
    assert r.status_code == 200, r.text
    return str(r.json()["account_type"])


async def test_a_proof_that_disappeared_unverifies_the_domain(world: World) -> None:
    w = world
    t, idp_id, domain = await proven_domain(w)
    first = await claim_of(w, t, idp_id, domain)
    assert await account_type(w, f"ceo@{domain}") == "work"

    # The record is still there: the loop looks it up again and renews the proof.
    async def renewed() -> bool:
        claim = await claim_of(w, t, idp_id, domain)
        return bool(claim["verified"] and claim["verified_at"] != first["verified_at"])

    await until(renewed, "the proof to be renewed")

    # The domain changes hands; its record goes: the domain is no longer the tenant's.
    w.dns.zone.pop(f"_gpuaas-challenge.{domain}")

    async def unverified() -> bool:
        return (await claim_of(w, t, idp_id, domain))["verified"] is False

    await until(unverified, "the domain to be unverified")
    assert await account_type(w, f"ceo@{domain}") == "personal"

    async def audited() -> list[dict[str, Any]]:
        r = await w.identity.client.get(
            "/audit",
            params={"action": "identity.idp.domain_unverified", "resource_id": idp_id},
            headers=t["op"],
        )
        assert r.status_code == 200, r.text
        return list(r.json()["items"])

    (record,) = await until(audited, "the audit record")
    assert record["after"]["domain"] == domain and record["actor_kind"] == "system"

    # Publishing the record again and verifying proves it again.
    w.dns.set(f"_gpuaas-challenge.{domain}", "TXT", first["challenge_value"])
    r = await w.identity.client.post(
        f"/tenants/{t['tenant_id']}/identity-providers/{idp_id}/domains/{domain}/verify", headers=t["admin"]
    )
    assert r.status_code == 200 and r.json()["verified"] is True, r.text


async def test_a_failed_lookup_or_an_attested_domain_is_left_alone(quiet: World) -> None:
    """A DNS server that does not answer decides nothing (no unverifying on an outage); a domain a platform
    admin attested has no record to look up; a proof younger than `domain_reverify_after_s` is not due."""
    w = quiet
    t, idp_id, domain = await proven_domain(w)
    attested = f"attested-{uuid.uuid4().hex[:6]}.example"
    r = await w.identity.client.post(
        f"/tenants/{t['tenant_id']}/identity-providers",
        json={
            "name": "idp2",
            "issuer": "https://idp2.example.com",
            "client_id": "c",
            "domains": [attested],
            "domains_verified": True,
        },
        headers=t["op"],
    )
    assert r.status_code == 201 and r.json()["domain_claims"][0]["verified"] is True, r.text
    attested_idp = r.json()["idp_id"]
    w.dns.zone.pop(f"_gpuaas-challenge.{domain}")

    from gpuaas.identity.service import domain_proofs  # (here: the module is new with issue 28)

    kit, settings = w.identity.kit, w.identity.kit.settings_as(Settings)
    later = now() + timedelta(seconds=settings.domain_reverify_after_s + 60)

    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # bound, never answers
    silent.bind(("127.0.0.1", 0))
    try:
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [dns.nameserver.Do53Nameserver("127.0.0.1", silent.getsockname()[1])]
        resolver.lifetime = 0.5
        await domain_proofs.reverify_due(kit.sessions, settings, resolver, at=later)
    finally:
        silent.close()
    assert (await claim_of(w, t, idp_id, domain))["verified"] is True  # the outage decided nothing

    real = kit.state_as(IdentityRuntime).resolver
    await domain_proofs.reverify_due(kit.sessions, settings, real, at=now())  # not due yet: nothing looked up
    assert (await claim_of(w, t, idp_id, domain))["verified"] is True
    await domain_proofs.reverify_due(kit.sessions, settings, real, at=later)  # due, the record is gone
    assert (await claim_of(w, t, idp_id, domain))["verified"] is False
    assert (await claim_of(w, t, attested_idp, attested))["verified"] is True  # attested: never looked up
