"""Rotation of the token signing keys (operators)."""

from __future__ import annotations

from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.identity import SERVICE, keys
from gpuaas.identity.models import signing_keys
from gpuaas.identity.service import views
from gpuaas.kit import audit, iam
from gpuaas.kit.auth import Principal

# Serializes rotations (two at once would each retire the other's new key).
ROTATION_LOCK = 7002


async def rotate_signing_key(session: AsyncSession, principal: Principal) -> views.KeyRotation:
    """A new key signs from now on; the old ones stay in the JWKS until their tokens have expired."""
    await iam.authorize(session, principal, "identity.key.rotate")
    await session.execute(select(func.pg_advisory_xact_lock(ROTATION_LOCK)))
    retired = (
        await session.execute(
            update(signing_keys)
            .where(signing_keys.c.retired_at.is_(None))
            .values(retired_at=func.now())
            .returning(signing_keys.c.kid)
        )
    ).all()
    kid, private, public = keys.generate_key()
    await session.execute(insert(signing_keys).values(keys.sealed_row(session, kid, private, public)))
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="identity.key.rotate",
        resource_type="signing_key",
        resource_id=kid,
        before={"active": [r[0] for r in retired]},
        after={"active": [kid]},
    )
    return views.KeyRotation(kid=kid, retired=[r[0] for r in retired])
