"""The app usage producer API: app controllers (service accounts) report usage; operators may backfill."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import APIRouter, Response

from gpuaas.kit.app import Kit
from gpuaas.kit.auth import CurrentPrincipal
from gpuaas.metering import service
from gpuaas.metering.api.schemas import AppUsage, AppUsageCreate
from gpuaas.metering.settings import Settings

router = APIRouter()


@router.post("/usage/app", response_model=AppUsage, status_code=201, tags=["app usage"])
async def post_app_usage(body: AppUsageCreate, kit: Kit, response: Response, principal: CurrentPrincipal) -> Any:
    """Report app-level usage (tokens, requests, model-seconds) of an instance, once per `idempotency_key`.

    201 when recorded; 200 with `duplicate: true` when this key was already recorded with the same
    body; 409 `idempotency_key_reused` for the same key with a different body; 422
    `usage_out_of_window` when `occurred_at` is outside the accepted window (answer says which).
    Service accounts need the `app-controller` scope in the instance's project; operators may backfill.
    """
    s = kit.settings_as(Settings)
    async with kit.sessions() as session, session.begin():
        out = await service.record_app_usage(
            session,
            principal,
            instance_id=body.instance_id,
            unit=body.unit,
            quantity=body.quantity,
            idempotency_key=body.idempotency_key,
            occurred_at=body.occurred_at.astimezone(UTC),
            member_id=body.member_id,
            now=datetime.now(UTC),
            late=timedelta(seconds=s.app_usage_late_s),
            skew=timedelta(seconds=s.app_usage_skew_s),
        )
    if out.duplicate:
        response.status_code = 200
    return out
