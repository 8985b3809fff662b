"""Federation: tenants' enterprise OIDC identity providers and the email domains each owns, and
account-type discovery (personal vs work account) from an email's domain."""

from __future__ import annotations

import uuid
from typing import Any
from urllib.parse import urlencode

from sqlalchemy import Row, insert, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.contracts import new_event_id
from gpuaas.contracts.enums import Role
from gpuaas.contracts.events import identity as identity_events
from gpuaas.identity.domain import JIT_ROLES, email_domain
from gpuaas.identity.models import identity_providers, idp_domains, tenants
from gpuaas.identity.service import views
from gpuaas.identity.service.common import record_change
from gpuaas.identity.settings import Settings
from gpuaas.kit import iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, Unprocessable


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


async def create_idp(
    session: AsyncSession,
    principal: Principal,
    *,
    tenant_id: uuid.UUID,
    name: str,
    issuer: str,
    client_id: str,
    client_secret: str | None,
    domains: list[str],
    default_role: Role | None,
    enforce_sso: bool,
) -> identity_events.IdentityProviderState:
    """Register the tenant's IdP with the email domains the tenant owns through it (each domain at most once)."""
    await iam.authorize(session, principal, "identity.idp.manage", tenant_id=tenant_id)
    if default_role is not None and default_role not in JIT_ROLES:
        raise Unprocessable(f"{default_role} cannot be a default role for federated users", code="invalid_role")
    domains = sorted({d.lower().strip(".") for d in domains})
    taken = (await session.execute(select(idp_domains.c.domain).where(idp_domains.c.domain.in_(domains)))).all()
    if taken:
        raise Conflict(
            f"domain(s) already owned by an identity provider: {', '.join(r[0] for r in taken)}", code="domain_taken"
        )
    values = {
        "idp_id": new_event_id(),
        "tenant_id": tenant_id,
        "name": name,
        "issuer": issuer.rstrip("/"),
        "client_id": client_id,
        "client_secret": client_secret,
        "default_role": str(default_role) if default_role else None,
        "enforce_sso": enforce_sso,
        "enabled": True,
    }
    await session.execute(insert(identity_providers).values(**values))
    await session.execute(insert(idp_domains), [{"domain": d, "idp_id": values["idp_id"]} for d in domains])
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
    return state


async def list_idps(
    session: AsyncSession, principal: Principal, tenant_id: uuid.UUID
) -> list[identity_events.IdentityProviderState]:
    await iam.authorize(session, principal, "identity.idp.manage", tenant_id=tenant_id)
    rows = (await session.execute(select(identity_providers).where(identity_providers.c.tenant_id == tenant_id))).all()
    out = []
    for r in rows:
        domains = (await session.execute(select(idp_domains.c.domain).where(idp_domains.c.idp_id == r.idp_id))).all()
        out.append(_state(dict(r._mapping), [d[0] for d in domains]))
    return out


async def idp_for_domain(session: AsyncSession, domain: str) -> Row | None:
    """The enabled IdP owning `domain`, with its tenant's slug and name (`tenant_name`)."""
    return (
        await session.execute(
            select(identity_providers, tenants.c.slug, tenants.c.name.label("tenant_name"))
            .join(idp_domains, idp_domains.c.idp_id == identity_providers.c.idp_id)
            .join(tenants, tenants.c.tenant_id == identity_providers.c.tenant_id)
            .where(idp_domains.c.domain == domain, identity_providers.c.enabled.is_(True))
        )
    ).first()


async def discover(
    session: AsyncSession, settings: Settings, *, email: str, tenant_hint: str | None
) -> views.AccountDiscovery:
    """Personal vs work account, from the email's domain only. The tenant hint is advisory: it is
    reported back (and whether it matches) but never changes the answer, so it cannot steer a user
    to another tenant's IdP. The answer does not reveal whether an account exists."""
    idp = await idp_for_domain(session, email_domain(email))
    hint = None
    if tenant_hint:
        hint = views.TenantHint(slug=tenant_hint, matches=bool(idp is not None and idp.slug == tenant_hint))
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
        tenant=views.DiscoveredTenant(tenant_id=idp.tenant_id, slug=idp.slug, name=idp.tenant_name),
        identity_provider=views.DiscoveredIdp(
            idp_id=idp.idp_id,
            name=idp.name,
            enforce_sso=idp.enforce_sso,
            sso_start_url=f"{settings.public_url}/auth/sso/start?{urlencode({'idp_id': str(idp.idp_id)})}",
        ),
        tenant_hint=hint,
    )
