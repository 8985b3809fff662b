"""Token signing keys: ES256 (P-256), stored in the schema, published as the JWKS.

The newest non-retired key signs; retired keys stay published until every token they signed has
expired (rotation without breaking sessions). Full rotation policy lives with the OIDC provider.
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

from gpuaas.identity.models import signing_keys


def generate_key() -> tuple[str, dict[str, Any], dict[str, Any]]:
    kid = uuid.uuid4().hex[:16]
    key = ECKey.generate_key("P-256", parameters={"kid": kid, "alg": "ES256", "use": "sig"})
    return kid, key.as_dict(private=True), key.as_dict(private=False)


async def ensure_signing_key(session: AsyncSession) -> None:
    if (await session.execute(select(signing_keys.c.kid).where(signing_keys.c.retired_at.is_(None)))).first():
        return
    kid, private, public = generate_key()
    await session.execute(insert(signing_keys).values(kid=kid, private_jwk=private, public_jwk=public))


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
    key = ECKey.import_key(row.private_jwk)
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
