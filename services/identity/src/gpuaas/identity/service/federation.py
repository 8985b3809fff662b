"""Federation: tenants' enterprise OIDC identity providers and the email domains each owns, and
account-type discovery (personal vs work account) from an email's domain.

Domain ownership: registering an IdP only *claims* its domains. A claim is proven by a DNS TXT record
(`_gpuaas-challenge.<domain>` = `gpuaas-domain-verification=<the claim's token>`, looked up through the
operator's resolver) or attested by a platform admin at registration. Only proven domains serve
discovery, linking and enforced SSO; a proven domain belongs to one IdP, and other tenants' claims
of it never block the real owner (they are dropped when it proves the domain).

Issuers: https only (plain http only for hosts the operator lists, e.g. the devstack's loopback IdP),
no query, fragment or credentials, and a literal address must be one the outbound guard allows.
"""

from __future__ import annotations

import ipaddress
import secrets
import uuid
from typing import Any
from urllib.parse import urlencode, urlsplit

import dns.asyncresolver
import dns.exception
from sqlalchemy import Row, delete, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gpuaas.contracts import new_event_id
from gpuaas.contracts.enums import Role
from gpuaas.contracts.events import identity as identity_events
from gpuaas.identity import SERVICE, dns_checks, keys
from gpuaas.identity.credentials import now
from gpuaas.identity.domain import JIT_ROLES, email_domain
from gpuaas.identity.models import identity_providers, idp_domains, tenants
from gpuaas.identity.service import views
from gpuaas.identity.service.common import record_change
from gpuaas.identity.settings import Settings
from gpuaas.kit import audit, iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.db import rows_affected
from gpuaas.kit.errors import Conflict, Forbidden, NotFound, Problem, Unprocessable
from gpuaas.kit.outbound import address_allowed, plain_http_allowed


def _state(row: dict[str, Any], domains: list[str]) -> identity_events.IdentityProviderState:
    return identity_events.IdentityProviderState(
        idp_id=row["idp_id"],
        tenant_id=row["tenant_id"],
        name=row["name"],
        issuer=row["issuer"],
        domains=sorted(domains),
        default_role=row["default_role"],
        enforce_sso=row["enforce_sso"],
        enabled=row["enabled"],
    )


def validate_issuer(settings: Settings, issuer: str) -> str:
    """The issuer as stored (no trailing slash), or 422 `issuer_not_allowed`."""
    parts = urlsplit(issuer.strip())
    bad = None
    if parts.scheme not in ("https", "http") or not parts.hostname:
        bad = "an absolute https URL"
    elif parts.query or parts.fragment or "?" in issuer or "#" in issuer:
        bad = "without a query or fragment"
    elif parts.username is not None or parts.password is not None:
        bad = "without credentials"
    elif parts.scheme == "http" and not plain_http_allowed(parts.netloc, settings.idp_plain_http_hosts):
        bad = "https (plain http only for hosts the operator allows)"
    else:
        try:
            literal = ipaddress.ip_address(parts.hostname)
        except ValueError:
            literal = None
        allowed = [ipaddress.ip_network(n, strict=False) for n in settings.idp_allowed_networks]
        if literal is not None and not address_allowed(literal, allowed):
            bad = "on an address the platform may reach"
    if bad:
        raise Unprocessable(f"the issuer must be {bad}", code="issuer_not_allowed")
    return issuer.strip().rstrip("/")


async def _claims(session: AsyncSession, idp_id: uuid.UUID) -> list[views.DomainClaim]:
    rows = (
        await session.execute(select(idp_domains).where(idp_domains.c.idp_id == idp_id).order_by(idp_domains.c.domain))
    ).all()
    return [_claim(r) for r in rows]


def _claim(r: Row) -> views.DomainClaim:
    return views.DomainClaim(
        domain=r.domain,
        verified=r.verified_at is not None,
        verified_at=r.verified_at,
        challenge_name=dns_checks.challenge_name(r.domain),
        challenge_value=dns_checks.challenge_value(r.challenge),
    )


async def create_idp(
    session: AsyncSession,
    principal: Principal,
    settings: Settings,
    *,
    tenant_id: uuid.UUID,
    name: str,
    issuer: str,
    client_id: str,
    client_secret: str | None,
    domains: list[str],
    default_role: Role | None,
    enforce_sso: bool,
    domains_verified: bool = False,
) -> views.IdentityProvider:
    """Register the tenant's IdP with the email domains it claims. A domain already proven by another
    IdP is `domain_taken`; otherwise the claim waits for its DNS proof (or a platform admin attests it)."""
    await iam.authorize(session, principal, "identity.idp.manage", tenant_id=tenant_id)
    if default_role is not None and default_role not in JIT_ROLES:
        raise Unprocessable(f"{default_role} cannot be a default role for federated users", code="invalid_role")
    if domains_verified and not await iam.is_platform_admin(session, principal):
        raise Forbidden("only a platform admin can attest domain ownership", code="domain_attestation_forbidden")
    issuer = validate_issuer(settings, issuer)
    domains = sorted({d.lower().strip(".") for d in domains})
    taken = (
        await session.execute(
            select(idp_domains.c.domain).where(
                idp_domains.c.domain.in_(domains), idp_domains.c.verified_at.is_not(None)
            )
        )
    ).all()
    if taken:
        raise Conflict(
            f"domain(s) already owned by an identity provider: {', '.join(r[0] for r in taken)}", code="domain_taken"
        )
    values = {
        "idp_id": new_event_id(),
        "tenant_id": tenant_id,
        "name": name,
        "issuer": issuer,
        "client_id": client_id,
        "client_secret": client_secret,
        "default_role": str(default_role) if default_role else None,
        "enforce_sso": enforce_sso,
        "enabled": True,
    }
    if client_secret:  # sealed at rest under the operator's keyring (issue 17)
        values["client_secret"] = keys.seal_client_secret(session, values["idp_id"], client_secret)
    await session.execute(insert(identity_providers).values(**values))
    attested = {"verified_at": now(), "verified_by": f"attested:{principal.subject}"} if domains_verified else {}
    await session.execute(
        insert(idp_domains),
        [{"domain": d, "idp_id": values["idp_id"], "challenge": secrets.token_hex(16), **attested} for d in domains],
    )
    if domains_verified:
        await _drop_rival_claims(session, values["idp_id"], domains)
    state = _state(values, domains)
    await record_change(
        session,
        identity_events.IdentityProviderCreated,
        state,
        actor=principal.actor,
        action="identity.idp.create",
        resource_type="identity_provider",
        resource_id=state.idp_id,
        tenant_id=tenant_id,
    )
    return views.IdentityProvider(**state.model_dump(), domain_claims=await _claims(session, values["idp_id"]))


async def _drop_rival_claims(session: AsyncSession, idp_id: uuid.UUID, domains: list[str]) -> None:
    await session.execute(delete(idp_domains).where(idp_domains.c.domain.in_(domains), idp_domains.c.idp_id != idp_id))


async def verify_domain(
    sessions_: async_sessionmaker[AsyncSession],
    principal: Principal,
    resolver: dns.asyncresolver.Resolver,
    *,
    tenant_id: uuid.UUID,
    idp_id: uuid.UUID,
    domain: str,
) -> views.DomainClaim:
    """Prove the claim by its DNS TXT record (through the operator's resolver). 409 `domain_not_proven`
    when the record is not there, `domain_taken` when another IdP proved the domain first. The lookup
    runs between transactions; the proof is written under the partial unique index (one owner)."""
    domain = domain.lower().strip(".")
    query = (
        select(idp_domains)
        .join(identity_providers, identity_providers.c.idp_id == idp_domains.c.idp_id)
        .where(
            idp_domains.c.idp_id == idp_id, idp_domains.c.domain == domain, identity_providers.c.tenant_id == tenant_id
        )
    )
    async with sessions_() as session:
        await iam.authorize(session, principal, "identity.idp.manage", tenant_id=tenant_id)
        claim = (await session.execute(query)).first()
    if claim is None:
        raise NotFound("no such domain claim", code="domain_claim_not_found")
    if claim.verified_at is not None:
        return _claim(claim)
    try:
        proven = await dns_checks.has_challenge(resolver, domain, claim.challenge)
    except dns.exception.DNSException as exc:
        raise Problem("the DNS lookup failed; try again later", code="dns_unavailable", status=503) from exc
    if not proven:
        raise Conflict(
            f"no TXT record {dns_checks.challenge_value(claim.challenge)!r} at {dns_checks.challenge_name(domain)}",
            code="domain_not_proven",
        )
    async with sessions_() as session, session.begin():
        rival = (
            await session.execute(
                select(idp_domains.c.idp_id)
                .where(idp_domains.c.domain == domain, idp_domains.c.verified_at.is_not(None))
                .with_for_update()
            )
        ).scalar()
        if rival is not None and rival != idp_id:
            raise Conflict(f"{domain} is already owned by another identity provider", code="domain_taken")
        done = await session.execute(
            update(idp_domains)
            .where(
                idp_domains.c.idp_id == idp_id,
                idp_domains.c.domain == domain,
                idp_domains.c.challenge == claim.challenge,
            )
            .values(verified_at=func.now(), verified_by="dns")
        )
        if rows_affected(done) != 1:  # the claim went away meanwhile (another IdP proved it and dropped ours)
            raise Conflict(f"{domain} is already owned by another identity provider", code="domain_taken")
        await _drop_rival_claims(session, idp_id, [domain])
        await audit.record(
            session,
            service=SERVICE,
            actor=principal.actor,
            action="identity.idp.domain_verify",
            resource_type="identity_provider",
            resource_id=idp_id,
            tenant_id=tenant_id,
            after={"domain": domain, "method": "dns"},
        )
        return _claim((await session.execute(query)).one())


async def list_idps(session: AsyncSession, principal: Principal, tenant_id: uuid.UUID) -> list[views.IdentityProvider]:
    await iam.authorize(session, principal, "identity.idp.manage", tenant_id=tenant_id)
    rows = (await session.execute(select(identity_providers).where(identity_providers.c.tenant_id == tenant_id))).all()
    out = []
    for r in rows:
        claims = await _claims(session, r.idp_id)
        state = _state(dict(r._mapping), [c.domain for c in claims])
        out.append(views.IdentityProvider(**state.model_dump(), domain_claims=claims))
    return out


async def idp_for_domain(session: AsyncSession, domain: str) -> Row | None:
    """The enabled IdP that proved it owns `domain`, with its tenant's slug and name (`tenant_name`)."""
    return (
        await session.execute(
            select(identity_providers, tenants.c.slug, tenants.c.name.label("tenant_name"))
            .join(idp_domains, idp_domains.c.idp_id == identity_providers.c.idp_id)
            .join(tenants, tenants.c.tenant_id == identity_providers.c.tenant_id)
            .where(
                idp_domains.c.domain == domain,
                idp_domains.c.verified_at.is_not(None),
                identity_providers.c.enabled.is_(True),
            )
        )
    ).first()


async def discover(
    session: AsyncSession, settings: Settings, *, email: str, tenant_hint: str | None
) -> views.AccountDiscovery:
    """Personal vs work account, from the email's domain only; the answer does not reveal whether an
    account exists. It tells anyone only what a login needs: that the domain signs in with SSO, and the
    start URL with the IdP's display name for the button (docs/decisions.md, issue 17): never the tenant
    (id, slug, name), and the tenant hint is neither compared nor echoed (`tenant_hint` is always null):
    it would tell whoever asks which tenant slug owns a domain."""
    idp = await idp_for_domain(session, email_domain(email))
    hint = None
    if idp is None:
        return views.AccountDiscovery(
            email=email,
            account_type="personal",
            login="password",
            tenant=None,
            identity_provider=None,
            tenant_hint=hint,
        )
    return views.AccountDiscovery(
        email=email,
        account_type="work",
        login="sso",
        tenant=None,
        identity_provider=views.DiscoveredIdp(
            idp_id=idp.idp_id,
            name=idp.name,
            enforce_sso=idp.enforce_sso,
            sso_start_url=f"{settings.public_url}/auth/sso/start?{urlencode({'idp_id': str(idp.idp_id)})}",
        ),
        tenant_hint=hint,
    )
