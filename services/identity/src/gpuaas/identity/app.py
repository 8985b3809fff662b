"""The identity service: `create_app()` and its `SPEC` (routers, handlers, migrations, bootstrap)."""

from pathlib import Path

from fastapi import FastAPI

from gpuaas.identity import SERVICE, dns_checks, keys
from gpuaas.identity.api import routers
from gpuaas.identity.handlers import subscriptions
from gpuaas.identity.idp import IdpMetadata
from gpuaas.identity.models import metadata
from gpuaas.identity.reconciler import reverify_domains
from gpuaas.identity.runtime import IdentityRuntime
from gpuaas.identity.service import users
from gpuaas.identity.settings import Settings
from gpuaas.kit.app import KitRuntime, ServiceSpec
from gpuaas.kit.app import create_app as kit_create_app
from gpuaas.kit.logging import get_logger
from gpuaas.kit.outbound import OutboundPolicy

log = get_logger(__name__)


async def _bootstrap(kit: KitRuntime) -> None:
    """Build the runtime state; make sure a signing key exists and the first operator is there
    (idempotent, race-safe)."""
    settings = kit.settings_as(Settings)
    resolver = dns_checks.resolver_for(settings)
    policy = OutboundPolicy(
        allowed_networks=tuple(settings.idp_allowed_networks),
        plain_http_hosts=tuple(settings.idp_plain_http_hosts),
        connect_timeout_s=min(3.0, settings.idp_timeout_s),
        read_timeout_s=settings.idp_timeout_s,
        deadline_s=settings.idp_timeout_s,
        max_body_bytes=settings.idp_max_response_bytes,
        resolver=dns_checks.address_resolver(resolver) if settings.dns_nameservers else None,
    )
    kit.state = IdentityRuntime(idp_metadata=IdpMetadata(policy), resolver=resolver)
    async with kit.sessions() as session, session.begin():
        sealed = await keys.seal_at_rest(session)  # clear rows of older versions; rows of a rotated-out key
        if sealed:
            log.info("secrets_sealed_at_rest", rows=sealed)
        await keys.ensure_signing_key(session)
        if settings.bootstrap_admin_email and settings.bootstrap_admin_password:
            created = await users.bootstrap_admin(
                session, settings.bootstrap_admin_email, settings.bootstrap_admin_password.get_secret_value()
            )
            if created:
                log.info("bootstrap_admin_created", email=settings.bootstrap_admin_email)


SPEC = ServiceSpec(
    name=SERVICE,
    settings_cls=Settings,
    routers=routers,
    subscriptions=subscriptions,
    versions_dir=Path(__file__).parent / "migrations" / "versions",
    metadata=metadata,
    on_startup=[_bootstrap],
    background=[reverify_domains],
    secrets_at_rest=True,
    description="Tenants, projects, users, memberships, service accounts, tokens and the audit store.",
)


def create_app(settings: Settings | None = None) -> FastAPI:
    return kit_create_app(settings or Settings(), SPEC)
