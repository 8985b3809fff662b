"""App usage: the projection of app instances (who a report is attributed to, and when it may be dated),
and the producer API's use cases: record a report once per key, and read reports back."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.contracts import Event
from gpuaas.contracts.enums import AppUsageUnit
from gpuaas.contracts.events import app_runtime as app_runtime_events
from gpuaas.contracts.events import usage as usage_events
from gpuaas.kit import audit, iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, NotFound, Problem
from gpuaas.kit.outbox import add_events
from gpuaas.metering import SERVICE, domain
from gpuaas.metering.metrics import usage_emitted
from gpuaas.metering.models import app_usage_records, instances, members
from gpuaas.metering.service.access import readable
from gpuaas.metering.service.views import AppUsage

_ENDED = {"stopped", "decommissioned", "failed"}


async def apply_instance(session: AsyncSession, event: Event) -> None:
    i: app_runtime_events.InstanceState = event.data
    row = (await session.execute(select(instances).where(instances.c.instance_id == i.instance_id))).first()
    if row is not None and i.version <= row.version:
        return
    ended_at = i.status_changed_at if str(i.status) in _ENDED else None
    values = {
        "tenant_id": i.tenant_id,
        "project_id": i.project_id,
        "app_slug": i.app_slug,
        "status": str(i.status),
        "ended_at": ended_at,
        "version": i.version,
        "launchable": i.launch is not None,  # app-hours metered by the platform (service/app_hours.py)
    }
    if str(i.status) == "running" and (row is None or row.running_since is None):
        values["running_since"] = i.status_changed_at
    if row is None:
        created = i.status_changed_at if i.status == "created" else min(i.status_changed_at, event.time)
        await session.execute(insert(instances).values(instance_id=i.instance_id, created_at=created, **values))
    else:
        await session.execute(update(instances).where(instances.c.instance_id == i.instance_id).values(**values))


async def apply_member(session: AsyncSession, event: Event) -> None:
    """Which instance a member belongs to, the allocation it runs on and when it was there (`joined_at`
    from its first event seen, `left_at` once tombstoned): GPU windows are attributed from it."""
    m: app_runtime_events.MemberState = event.data
    left_at = m.status_changed_at if m.tombstoned else None
    stmt = pg_insert(members).values(
        member_id=m.member_id,
        instance_id=m.instance_id,
        allocation_id=m.allocation_id,
        joined_at=m.status_changed_at,
        left_at=left_at,
        version=m.version,
    )
    await session.execute(
        stmt.on_conflict_do_update(
            index_elements=["member_id"],
            set_={
                "instance_id": stmt.excluded.instance_id,
                "allocation_id": stmt.excluded.allocation_id,
                "joined_at": func.least(members.c.joined_at, stmt.excluded.joined_at),
                "left_at": stmt.excluded.left_at,
                "version": stmt.excluded.version,
            },
            where=members.c.version < stmt.excluded.version,
        )
    )


def _app_usage(row: Any, *, duplicate: bool) -> AppUsage:
    return AppUsage.model_validate({**row._mapping, "duplicate": duplicate})


async def record_app_usage(
    session: AsyncSession,
    principal: Principal,
    *,
    instance_id: uuid.UUID,
    unit: AppUsageUnit,
    quantity: Decimal,
    idempotency_key: str,
    occurred_at: datetime,
    member_id: uuid.UUID | None,
    now: datetime,
    late: timedelta,
    skew: timedelta,
) -> AppUsage:
    """Accept one app usage event once. A re-post with the same key answers the stored record
    (`duplicate`); the same key with a different body is a conflict; an occurrence time outside the
    instance's accepted window is refused (`usage_out_of_window`)."""
    unknown = NotFound("no such app instance (or not known to metering yet)", code="instance_not_found")
    inst = (await session.execute(select(instances).where(instances.c.instance_id == instance_id))).first()
    if inst is None:
        raise unknown
    action = "metering.usage.write" if principal.is_service_account else "metering.usage.backfill"
    try:
        await iam.authorize(session, principal, action, project_id=inst.project_id)
    except NotFound:  # another project's instance: the same answer as a missing one (existence stays hidden)
        raise unknown from None
    if member_id is not None:  # attributed to a member: it must be one of this instance's (tombstoned or not)
        owner = (await session.execute(select(members.c.instance_id).where(members.c.member_id == member_id))).scalar()
        if owner != instance_id:
            raise NotFound("no such member of this instance (or not known to metering yet)", code="member_not_found")
    record_id = usage_events.app_usage_record_id(instance_id, idempotency_key)
    existing = (
        await session.execute(
            select(app_usage_records).where(app_usage_records.c.app_usage_record_id == record_id).with_for_update()
        )
    ).first()
    if existing is not None:
        return _same_or_conflict(existing, unit, quantity, occurred_at, member_id)
    window = domain.app_usage_window(now, late, skew, inst.created_at, inst.ended_at)
    if not (window.accepted_from <= occurred_at <= window.accepted_until):
        raise Problem(
            f"occurred_at {occurred_at.isoformat()} is outside the accepted window "
            f"[{window.accepted_from.isoformat()}, {window.accepted_until.isoformat()}] of this instance",
            code="usage_out_of_window",
            status=422,
            title="Usage outside the accepted window",
            accepted_from=window.accepted_from.isoformat(),
            accepted_until=window.accepted_until.isoformat(),
        )
    values: dict[str, Any] = {
        "app_usage_record_id": record_id,
        "instance_id": instance_id,
        "tenant_id": inst.tenant_id,
        "project_id": inst.project_id,
        "app_slug": inst.app_slug,
        "member_id": member_id,
        "unit": str(unit),
        "quantity": quantity,
        "idempotency_key": idempotency_key,
        "occurred_at": occurred_at,
        "reported_by": str(principal.subject),
    }
    inserted = (
        await session.execute(
            pg_insert(app_usage_records).values(values).on_conflict_do_nothing().returning(app_usage_records)
        )
    ).first()
    if inserted is None:  # a concurrent post of the same key won the race
        existing = (
            await session.execute(select(app_usage_records).where(app_usage_records.c.app_usage_record_id == record_id))
        ).one()
        return _same_or_conflict(existing, unit, quantity, occurred_at, member_id)
    data = usage_events.AppUsageRecord.model_validate(values | {"unit": unit})
    await add_events(session, [usage_events.AppUsageRecorded.build(data=data, source=SERVICE, actor=principal.actor)])
    usage_emitted(session, "app", 1)
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="metering.app_usage.record",
        resource_type="app_usage_record",
        resource_id=record_id,
        tenant_id=inst.tenant_id,
        project_id=inst.project_id,
        after=data.model_dump(mode="json"),
    )
    return _app_usage(inserted, duplicate=False)


def _same_or_conflict(
    row: Any, unit: AppUsageUnit, quantity: Decimal, occurred_at: datetime, member_id: uuid.UUID | None
) -> AppUsage:
    same = (
        row.unit == str(unit)
        and Decimal(row.quantity) == quantity
        and row.occurred_at == occurred_at
        and row.member_id == member_id
    )
    if not same:
        raise Conflict(
            "this idempotency key was already used for a different usage event",
            code="idempotency_key_reused",
        )
    return _app_usage(row, duplicate=True)


async def list_app_usage(
    session: AsyncSession,
    principal: Principal,
    *,
    instance_id: uuid.UUID | None,
    project_id: uuid.UUID | None,
    limit: int,
) -> list[AppUsage]:
    """App usage reports, newest first: of one project, or of every project the caller may read."""
    q = select(app_usage_records).order_by(app_usage_records.c.occurred_at.desc()).limit(limit)
    if (scope := await readable(session, principal, app_usage_records.c.project_id, project_id)) is not None:
        q = q.where(scope)
    if instance_id is not None:
        q = q.where(app_usage_records.c.instance_id == instance_id)
    return [_app_usage(r, duplicate=False) for r in (await session.execute(q)).all()]
