"""Domain proofs do not last for ever (issue 28): a domain proven by its DNS TXT record is looked up
again once its proof is older than `domain_reverify_after_s`; a record that is still there renews the
proof (`verified_at` is when it was last seen), one that is gone unverifies the domain — it stops serving
discovery, linking and enforced SSO until its owner proves it again — with an audit record
(`identity.idp.domain_unverified`). A domain a platform admin attested by hand has no record to look up
and is left alone; a lookup that fails (timeout, SERVFAIL) decides nothing and is retried next round.

Run by the identity service's background loop (`gpuaas.identity.reconciler`) every
`domain_reverify_every_s`, in batches; the lookups run between transactions, and each outcome is written
guarded by the `verified_at` it read, so replicas checking the same claim at once write it once.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import dns.asyncresolver
import dns.exception
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gpuaas.contracts import Actor
from gpuaas.identity import SERVICE, dns_checks
from gpuaas.identity.credentials import now
from gpuaas.identity.models import identity_providers, idp_domains
from gpuaas.identity.settings import Settings
from gpuaas.kit import audit
from gpuaas.kit.db import rows_affected
from gpuaas.kit.logging import get_logger

log = get_logger(__name__)
BATCH = 100


async def reverify_due(
    sessions_: async_sessionmaker[AsyncSession],
    settings: Settings,
    resolver: dns.asyncresolver.Resolver,
    *,
    at: datetime | None = None,
) -> tuple[int, int]:
    """Look up the DNS proofs due at `at` (one batch); (renewed, unverified)."""
    at = at or now()
    async with sessions_() as session:
        due = (
            await session.execute(
                select(
                    idp_domains.c.domain,
                    idp_domains.c.idp_id,
                    idp_domains.c.challenge,
                    idp_domains.c.verified_at,
                    identity_providers.c.tenant_id,
                )
                .join(identity_providers, identity_providers.c.idp_id == idp_domains.c.idp_id)
                .where(
                    idp_domains.c.verified_by == "dns",
                    idp_domains.c.verified_at < at - timedelta(seconds=settings.domain_reverify_after_s),
                )
                .order_by(idp_domains.c.verified_at)
                .limit(BATCH)
            )
        ).all()
    renewed = unverified = 0
    for claim in due:
        try:
            proven = await dns_checks.has_challenge(resolver, claim.domain, claim.challenge)
        except dns.exception.DNSException as exc:
            log.warning("domain_reverify_lookup_failed", domain=claim.domain, error=type(exc).__name__)
            continue
        guard = (
            idp_domains.c.idp_id == claim.idp_id,
            idp_domains.c.domain == claim.domain,
            idp_domains.c.verified_at == claim.verified_at,
        )
        async with sessions_() as session, session.begin():
            if proven:
                await session.execute(update(idp_domains).where(*guard).values(verified_at=at))
                renewed += 1
                continue
            done = await session.execute(update(idp_domains).where(*guard).values(verified_at=None, verified_by=None))
            if rows_affected(done) != 1:  # another replica (or the owner) changed it meanwhile
                continue
            unverified += 1
            await audit.record(
                session,
                service=SERVICE,
                actor=Actor.system("identity-domain-proofs"),
                action="identity.idp.domain_unverified",
                resource_type="identity_provider",
                resource_id=claim.idp_id,
                tenant_id=claim.tenant_id,
                before={"domain": claim.domain, "verified_at": claim.verified_at.isoformat()},
                after={"domain": claim.domain, "verified": False},
                reason=f"the TXT record at {dns_checks.challenge_name(claim.domain)} no longer proves the claim",
            )
            log.info("domain_unverified", domain=claim.domain, idp_id=str(claim.idp_id))
    return renewed, unverified
