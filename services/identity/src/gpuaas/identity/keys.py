"""Token signing keys: ES256 (P-256), stored in the schema, published as the JWKS.

The newest non-retired key signs; retired keys stay published until every token they signed has
expired (rotation without breaking sessions). Full rotation policy lives with the OIDC provider.

The private halves are sealed at rest under the operator's keyring (gpuaas.kit.secrets_at_rest); clear
rows from older versions are sealed at start-up (`seal_at_rest`).
"""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from joserfc import jwt
from joserfc.jwk import ECKey
from sqlalchemy import insert, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.identity.models import identity_providers, signing_keys
from gpuaas.kit.secrets_at_rest import keyring_of, reseal_column

PRIVATE_JWK = "identity.signing_keys.private_jwk"
IDP_CLIENT_SECRET = "identity.identity_providers.client_secret"


def generate_key() -> tuple[str, dict[str, Any], dict[str, Any]]:
    kid = uuid.uuid4().hex[:16]
    key = ECKey.generate_key("P-256", parameters={"kid": kid, "alg": "ES256", "use": "sig"})
    return kid, key.as_dict(private=True), key.as_dict(private=False)


def sealed_row(session: AsyncSession, kid: str, private: dict[str, Any], public: dict[str, Any]) -> dict[str, Any]:
    """A `signing_keys` row whose private JWK is sealed under the service's keyring."""
    return {
        "kid": kid,
        "private_jwk": keyring_of(session).seal_json(private, f"{PRIVATE_JWK}:{kid}"),
        "public_jwk": public,
    }


async def seal_at_rest(session: AsyncSession) -> int:
    """Seal clear private keys and IdP client secrets, re-seal those under an older key (rotation)."""
    return await reseal_column(session, signing_keys, "kid", "private_jwk", PRIVATE_JWK, as_json=True) + (
        await reseal_column(session, identity_providers, "idp_id", "client_secret", IDP_CLIENT_SECRET)
    )


def seal_client_secret(session: AsyncSession, idp_id: uuid.UUID, secret: str) -> str:
    return keyring_of(session).seal(secret, f"{IDP_CLIENT_SECRET}:{idp_id}")


def open_client_secret(session: AsyncSession, idp_id: uuid.UUID, stored: str) -> str:
    return keyring_of(session).open(stored, f"{IDP_CLIENT_SECRET}:{idp_id}")


async def ensure_signing_key(session: AsyncSession) -> None:
    if (await session.execute(select(signing_keys.c.kid).where(signing_keys.c.retired_at.is_(None)))).first():
        return
    kid, private, public = generate_key()
    await session.execute(insert(signing_keys).values(sealed_row(session, kid, private, public)))


async def jwks(session: AsyncSession, max_token_ttl_s: int) -> dict[str, Any]:
    horizon = datetime.now(UTC) - timedelta(seconds=max_token_ttl_s)
    rows = await session.execute(
        select(signing_keys.c.public_jwk)
        .where(or_(signing_keys.c.retired_at.is_(None), signing_keys.c.retired_at > horizon))
        .order_by(signing_keys.c.created_at.desc())
    )
    return {"keys": [r[0] for r in rows]}


async def sign(session: AsyncSession, claims: dict[str, Any]) -> str:
    row = (
        await session.execute(
            select(signing_keys.c.kid, signing_keys.c.private_jwk)
            .where(signing_keys.c.retired_at.is_(None))
            .order_by(signing_keys.c.created_at.desc())
            .limit(1)
        )
    ).one()
    key = ECKey.import_key(keyring_of(session).open_json(row.private_jwk, f"{PRIVATE_JWK}:{row.kid}"))
    return jwt.encode({"alg": "ES256", "kid": row.kid, "typ": "JWT"}, claims, key)


def access_claims(
    *,
    issuer: str,
    subject: uuid.UUID,
    kind: str,
    ttl_s: int,
    tenant_id: uuid.UUID | None = None,
    project_id: uuid.UUID | None = None,
    scopes: list[str] | None = None,
    email: str | None = None,
) -> dict[str, Any]:
    now = int(time.time())
    claims: dict[str, Any] = {
        "iss": issuer,
        "aud": "gpuaas",
        "sub": str(subject),
        "typ": kind,
        "iat": now,
        "nbf": now,
        "exp": now + ttl_s,
        "jti": uuid.uuid4().hex,
    }
    if tenant_id:
        claims["tenant_id"] = str(tenant_id)
    if project_id:
        claims["project_id"] = str(project_id)
    if scopes:
        claims["scope"] = " ".join(scopes)
    if email:
        claims["email"] = email
    return claims
