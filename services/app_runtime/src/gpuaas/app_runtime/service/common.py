"""What every app-runtime use case shares: loading rows as views (with the caller's authorization),
their contract states, checked transitions of instances, members and operations (each with its event and
timeline entry), and the audit record.

Nothing here commits: the caller (a router, a handler or the reconciler) owns the transaction.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import ColumnElement, Table, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.app_runtime import EVENT_SOURCE, SERVICE, domain
from gpuaas.app_runtime.models import (
    controller_bindings,
    instance_events,
    instances,
    members,
    operations,
)
from gpuaas.app_runtime.service.views import (
    ControllerBindingView,
    CredentialView,
    InstanceView,
    MemberView,
    OperationView,
    TimelineEntryView,
    ViewT,
    from_row,
)
from gpuaas.contracts import Actor, Event, new_event_id
from gpuaas.contracts.enums import InstanceStatus
from gpuaas.contracts.events import app_runtime as app_runtime_events
from gpuaas.contracts.events.app_runtime import (
    AccessGrantState,
    DecommissionReport,
    InstanceHealth,
    InstanceState,
    MemberOperationState,
    MemberState,
    MemberStatus,
    OperationKind,
    OperationStatus,
    PlacementIntent,
)
from gpuaas.kit import audit, iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Forbidden, NotFound
from gpuaas.kit.outbox import add_event

SYSTEM = Actor.system(EVENT_SOURCE)
# Statuses of an operation still to be finished, as stored.
OPEN_STATUSES = [s.value for s in domain.OPEN_OPS]

STATUS_EVENTS: dict[InstanceStatus, type[Event]] = {
    InstanceStatus.created: app_runtime_events.InstanceCreated,
    InstanceStatus.starting: app_runtime_events.InstanceStarting,
    InstanceStatus.running: app_runtime_events.InstanceRunning,
    InstanceStatus.degraded: app_runtime_events.InstanceDegraded,
    InstanceStatus.stopping: app_runtime_events.InstanceStopping,
    InstanceStatus.stopped: app_runtime_events.InstanceStopped,
    InstanceStatus.decommissioning: app_runtime_events.InstanceDecommissioning,
    InstanceStatus.decommissioned: app_runtime_events.InstanceDecommissioned,
    InstanceStatus.decommission_failed: app_runtime_events.InstanceDecommissionFailed,
    InstanceStatus.failed: app_runtime_events.InstanceFailed,
}
OPERATION_EVENTS: dict[OperationStatus, type[Event]] = {
    OperationStatus.pending: app_runtime_events.MemberOperationRequeued,
    OperationStatus.claimed: app_runtime_events.MemberOperationClaimed,
    OperationStatus.in_progress: app_runtime_events.MemberOperationProgressed,
    OperationStatus.succeeded: app_runtime_events.MemberOperationSucceeded,
    OperationStatus.failed: app_runtime_events.MemberOperationFailed,
    OperationStatus.cancelled: app_runtime_events.MemberOperationCancelled,
}
# What an audit record names as the resource of each view.
AuditSubject = InstanceView | MemberView | OperationView | CredentialView | ControllerBindingView


def now() -> datetime:
    return datetime.now(UTC)


def actor_of(who: Principal | Actor) -> Actor:
    return who.actor if isinstance(who, Principal) else who


async def emit(session: AsyncSession, event_cls: type[Event], data: Any, actor: Actor) -> None:
    """Add an app-runtime event to the outbox (same transaction as the state it describes)."""
    await add_event(session, event_cls.build(data=data, source=EVENT_SOURCE, actor=actor))


async def audit_on(
    session: AsyncSession,
    principal: Principal,
    action: str,
    subject: AuditSubject,
    *,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
    reason: str | None = None,
) -> None:
    """The audit record of a use case, about `subject` (its tenant and project)."""
    resource: tuple[str, uuid.UUID]
    match subject:
        case InstanceView():
            resource = ("app_instance", subject.instance_id)
        case MemberView():
            resource = ("app_member", subject.member_id)
        case OperationView():
            resource = ("member_operation", subject.operation_id)
        case CredentialView():
            resource = ("access_credential", subject.credential_id)
        case ControllerBindingView():
            resource = ("controller_binding", subject.binding_id)
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action=action,
        resource_type=resource[0],
        resource_id=resource[1],
        tenant_id=subject.tenant_id,
        project_id=subject.project_id,
        before=before,
        after=after,
        reason=reason,
    )


# ------------------------------------------------------------------------------------------ loading


async def load_instance(session: AsyncSession, instance_id: uuid.UUID, *, lock: bool = False) -> InstanceView:
    stmt = select(instances).where(instances.c.instance_id == instance_id)
    if lock:
        stmt = stmt.with_for_update()
    row = (await session.execute(stmt)).first()
    if row is None:
        raise NotFound("instance not found", code="instance_not_found")
    return from_row(InstanceView, row)


async def readable_instance(session: AsyncSession, principal: Principal, instance_id: uuid.UUID) -> InstanceView:
    """The instance, if the caller may read it (404 otherwise, never 403: its existence stays hidden)."""
    inst = await load_instance(session, instance_id)
    try:
        await iam.authorize(session, principal, "apps.instance.read", project_id=inst.project_id)
    except NotFound:
        raise NotFound("instance not found", code="instance_not_found") from None
    return inst


async def authorized_instance(
    session: AsyncSession, principal: Principal, instance_id: uuid.UUID, action: str, *, lock: bool = True
) -> InstanceView:
    """The instance, locked, after checking `action` (404 when the caller may not even see it)."""
    inst = await readable_instance(session, principal, instance_id)
    await iam.authorize(session, principal, action, project_id=inst.project_id)
    return await load_instance(session, instance_id, lock=lock)


def controller_project(principal: Principal) -> uuid.UUID:
    """The project of a controller (a project service account) calling the controller API."""
    if not principal.is_service_account or principal.project_id is None:
        raise Forbidden("the controller API is for project service accounts", code="controller_only")
    return principal.project_id


async def bound_controller(session: AsyncSession, project_id: uuid.UUID, app_slug: str) -> uuid.UUID | None:
    """The service account bound as the controller of an app in a project, if any."""
    bound: uuid.UUID | None = (
        await session.execute(
            select(controller_bindings.c.service_account_id).where(
                controller_bindings.c.project_id == project_id, controller_bindings.c.app_slug == app_slug
            )
        )
    ).scalar()
    return bound


async def check_controller(session: AsyncSession, principal: Principal, project_id: uuid.UUID, app_slug: str) -> None:
    if not principal.is_service_account:
        raise Forbidden("the controller API is for service accounts", code="controller_only")
    try:
        await iam.authorize(session, principal, "apps.controller", project_id=project_id)
    except NotFound:
        raise NotFound("instance not found", code="instance_not_found") from None
    if await bound_controller(session, project_id, app_slug) != principal.subject:
        raise Forbidden(f"this service account is not the controller of {app_slug} here", code="not_the_controller")


async def controller_instance(
    session: AsyncSession, principal: Principal, instance_id: uuid.UUID, *, lock: bool = False
) -> InstanceView:
    """An instance as seen by its controller: the bound service account of its project and app only."""
    inst = await load_instance(session, instance_id)
    await check_controller(session, principal, inst.project_id, inst.app_slug)
    return await load_instance(session, instance_id, lock=True) if lock else inst


async def load_member(
    session: AsyncSession, member_id: uuid.UUID, *, instance_id: uuid.UUID | None = None, lock: bool = False
) -> MemberView:
    stmt = select(members).where(members.c.member_id == member_id)
    if instance_id is not None:
        stmt = stmt.where(members.c.instance_id == instance_id)
    if lock:
        stmt = stmt.with_for_update()
    row = (await session.execute(stmt)).first()
    if row is None:
        raise NotFound("member not found", code="member_not_found")
    return from_row(MemberView, row)


async def live_members(session: AsyncSession, instance_id: uuid.UUID) -> list[MemberView]:
    """The instance's members that are not tombstones, oldest first."""
    rows = await session.execute(
        select(members)
        .where(members.c.instance_id == instance_id, members.c.tombstoned.is_(False))
        .order_by(members.c.created_at, members.c.member_id)
    )
    return [from_row(MemberView, r) for r in rows]


async def load_operation(session: AsyncSession, operation_id: uuid.UUID) -> OperationView:
    """The operation, locked."""
    row = (
        await session.execute(select(operations).where(operations.c.operation_id == operation_id).with_for_update())
    ).first()
    if row is None:
        raise NotFound("operation not found", code="operation_not_found")
    return from_row(OperationView, row)


async def open_operations(session: AsyncSession, *where: ColumnElement[bool]) -> list[OperationView]:
    """The operations (locked) matching `where` that are still open."""
    rows = await session.execute(
        select(operations).where(*where, operations.c.status.in_(OPEN_STATUSES)).with_for_update()
    )
    return [from_row(OperationView, r) for r in rows]


def on_member(member_id: uuid.UUID) -> ColumnElement[bool]:
    """Operations that target a member or bring it up."""
    return (operations.c.member_id == member_id) | (operations.c.result_member_id == member_id)


# ------------------------------------------------------------------------------------------ contract states


async def instance_state(session: AsyncSession, inst: InstanceView) -> InstanceState:
    return InstanceState(
        instance_id=inst.instance_id,
        tenant_id=inst.tenant_id,
        project_id=inst.project_id,
        name=inst.name,
        app_slug=inst.app_slug,
        app_version=inst.app_version,
        manifest_id=inst.manifest_id,
        artifact_digest=inst.artifact_digest,
        status=InstanceStatus(inst.status),
        status_changed_at=inst.status_changed_at,
        placement_intent=PlacementIntent.model_validate(inst.placement_intent),
        config=inst.config,
        runtime_detail=inst.runtime_detail or {},
        health=InstanceHealth.model_validate(inst.health or {}),
        failure_reason=inst.failure_reason,
        decommission=DecommissionReport.model_validate(inst.decommission) if inst.decommission else None,
        version=inst.version,
        desired_manifest_id=inst.desired_manifest_id,
        desired_app_version=inst.desired_app_version,
        previous_manifest_id=inst.previous_manifest_id,
        controller_service_account_id=await bound_controller(session, inst.project_id, inst.app_slug),
        launch=(inst.runtime_detail or {}).get("launch"),  # launchable apps (service/launch.py)
    )


def member_state(member: MemberView) -> MemberState:
    return MemberState.model_validate(member, from_attributes=True)


def operation_state(op: OperationView) -> MemberOperationState:
    return MemberOperationState.model_validate(op, from_attributes=True)


def grant_state(cred: CredentialView, status: Literal["requested", "revoked"] = "requested") -> AccessGrantState:
    return AccessGrantState(
        access_grant_id=cred.credential_id,
        instance_id=cred.instance_id,
        tenant_id=cred.tenant_id,
        project_id=cred.project_id,
        allocation_ids=[uuid.UUID(a) for a in cred.allocation_ids],
        public_key=cred.public_key,
        fingerprint=cred.fingerprint,
        status=status,
        rotated_from=cred.rotated_from,
        version=cred.version,
    )


# ------------------------------------------------------------------------------------------ writing


async def timeline(
    session: AsyncSession, instance_id: uuid.UUID, kind: str, message: str, actor: Actor, **data: Any
) -> TimelineEntryView:
    """Add an entry to the instance's timeline and wake its SSE streams."""
    row = (
        await session.execute(
            insert(instance_events)
            .values(
                instance_id=instance_id,
                kind=kind,
                message=message,
                data=_jsonable(data),
                actor=f"{actor.kind}:{actor.id}",
            )
            .returning(*instance_events.c)
        )
    ).one()
    await session.execute(func.pg_notify("app_runtime_timeline", str(instance_id)).select())
    return from_row(TimelineEntryView, row)


def _jsonable(data: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, uuid.UUID):
            out[k] = str(v)
        elif isinstance(v, list):
            out[k] = [str(x) if isinstance(x, uuid.UUID) else x for x in v]
        else:
            out[k] = v
    return out


async def _update_versioned(
    session: AsyncSession, table: Table, where: ColumnElement[bool], view: type[ViewT], **values: Any
) -> ViewT:
    """Update the one row `where` names, moving its version on, and answer it as `view`."""
    row = (
        await session.execute(
            update(table).where(where).values(**values, version=table.c.version + 1).returning(*table.c)
        )
    ).one()
    return from_row(view, row)


async def emit_instance(session: AsyncSession, inst: InstanceView, event_cls: type[Event], actor: Actor) -> None:
    await emit(session, event_cls, await instance_state(session, inst), actor)


async def update_instance(session: AsyncSession, instance_id: uuid.UUID, actor: Actor, **values: Any) -> InstanceView:
    """Change fields (not status) and emit `instance.updated`."""
    inst = await _update_versioned(session, instances, instances.c.instance_id == instance_id, InstanceView, **values)
    await emit_instance(session, inst, app_runtime_events.InstanceUpdated, actor)
    return inst


async def set_instance_status(
    session: AsyncSession, inst: InstanceView, target: InstanceStatus, actor: Actor, message: str = "", **values: Any
) -> InstanceView:
    domain.check_instance_transition(inst.status, target)
    new = await _update_versioned(
        session,
        instances,
        instances.c.instance_id == inst.instance_id,
        InstanceView,
        status=target,
        status_changed_at=now(),
        **values,
    )
    await emit_instance(session, new, STATUS_EVENTS[target], actor)
    await timeline(
        session, inst.instance_id, f"instance.{target}", message or f"instance is {target}", actor, previous=inst.status
    )
    return new


async def recompute_instance(session: AsyncSession, instance_id: uuid.UUID, actor: Actor) -> InstanceView:
    """A live instance's status, derived again from its members."""
    inst = await load_instance(session, instance_id, lock=True)
    statuses = [m.status for m in await live_members(session, instance_id)]
    target = domain.derive_instance_status(inst.status, statuses)
    if target != inst.status:
        return await set_instance_status(session, inst, target, actor, f"members: {', '.join(statuses) or 'none'}")
    return inst


async def insert_member(
    session: AsyncSession,
    inst: InstanceView,
    component_key: str,
    allocation_id: uuid.UUID,
    op_id: uuid.UUID,
    actor: Actor,
) -> MemberView:
    row = (
        await session.execute(
            insert(members)
            .values(
                member_id=new_event_id(),
                instance_id=inst.instance_id,
                tenant_id=inst.tenant_id,
                project_id=inst.project_id,
                component_key=component_key,
                allocation_id=allocation_id,
                status=MemberStatus.pending,
                last_operation_id=op_id,
                version=1,
            )
            .returning(*members.c)
        )
    ).one()
    member = from_row(MemberView, row)
    await emit(session, app_runtime_events.MemberAdded, member_state(member), actor)
    await timeline(
        session,
        inst.instance_id,
        "member.added",
        f"{component_key} member on allocation {allocation_id}",
        actor,
        member_id=member.member_id,
        allocation_id=allocation_id,
    )
    return member


async def update_member(session: AsyncSession, member_id: uuid.UUID, actor: Actor, **values: Any) -> MemberView:
    """Change a member (`status`, `detail`, `tombstoned`...): its event, and a timeline entry for a new status
    or a tombstone."""
    if "status" in values:
        values["status_changed_at"] = now()
    member = await _update_versioned(session, members, members.c.member_id == member_id, MemberView, **values)
    tombstoned = bool(values.get("tombstoned"))
    event_cls = app_runtime_events.MemberTombstoned if tombstoned else app_runtime_events.MemberUpdated
    await emit(session, event_cls, member_state(member), actor)
    if "status" in values or tombstoned:
        what = "tombstoned" if tombstoned else values["status"]
        await timeline(
            session,
            member.instance_id,
            f"member.{what}",
            f"{member.component_key} member {member_id} {what}"
            + (f": {member.tombstone_reason}" if tombstoned else ""),
            actor,
            member_id=member_id,
        )
    return member


async def tombstone_member(
    session: AsyncSession,
    member_id: uuid.UUID,
    actor: Actor,
    reason: str,
    *,
    status: MemberStatus = MemberStatus.removed,
) -> MemberView:
    """A member that is gone (removed, or failed and replaced): kept as a tombstone saying why."""
    return await update_member(session, member_id, actor, status=status, tombstoned=True, tombstone_reason=reason)


async def insert_operation(
    session: AsyncSession,
    inst: InstanceView,
    kind: OperationKind,
    actor: Actor,
    *,
    member: MemberView | None = None,
    allocation_id: uuid.UUID | None = None,
    component_key: str | None = None,
    params: dict[str, Any] | None = None,
) -> OperationView:
    """A pending operation; add, replace and the recovery of a failed member also create the member they
    bring up (`result_member_id`)."""
    op_id = new_event_id()
    await session.execute(
        insert(operations).values(
            operation_id=op_id,
            instance_id=inst.instance_id,
            tenant_id=inst.tenant_id,
            project_id=inst.project_id,
            app_slug=inst.app_slug,
            kind=kind,
            status=OperationStatus.pending,
            member_id=member.member_id if member is not None else None,
            component_key=component_key or (member.component_key if member is not None else None),
            allocation_id=allocation_id or (member.allocation_id if member is not None else None),
            params=params or {},
            version=1,
        )
    )
    if (
        kind is OperationKind.add
        or kind is OperationKind.replace
        or (kind is OperationKind.recover and member is not None and member.status == MemberStatus.failed)
    ):
        # the member this operation brings up (a failed member is replaced by a new one: it stays a tombstone)
        key = component_key or (member.component_key if member is not None else "")
        target_alloc = allocation_id or (member.allocation_id if member is not None else None)
        assert target_alloc is not None  # add/replace are checked to name one; recover has its member's
        result_member = await insert_member(session, inst, key, target_alloc, op_id, actor)
        if kind is OperationKind.add:
            await session.execute(
                update(operations).where(operations.c.operation_id == op_id).values(member_id=result_member.member_id)
            )
        await session.execute(
            update(operations)
            .where(operations.c.operation_id == op_id)
            .values(result_member_id=result_member.member_id)
        )
    if member is not None:
        await session.execute(
            update(members)
            .where(members.c.member_id == member.member_id)
            .values(last_operation_id=op_id, version=members.c.version + 1)
        )
    op = from_row(
        OperationView, (await session.execute(select(operations).where(operations.c.operation_id == op_id))).one()
    )
    await emit(session, app_runtime_events.MemberOperationCreated, operation_state(op), actor)
    await timeline(
        session,
        inst.instance_id,
        "operation.created",
        f"{kind} operation {op_id} pending",
        actor,
        operation_id=op_id,
        member_id=op.member_id,
    )
    return op


async def update_operation(
    session: AsyncSession, op: OperationView, target: OperationStatus, actor: Actor, message: str = "", **values: Any
) -> OperationView:
    """Move an operation to `target` (checked), with its event and, for a new status or a message, a
    timeline entry."""
    domain.check_operation_transition(op.status, target)
    new = await _update_versioned(
        session,
        operations,
        operations.c.operation_id == op.operation_id,
        OperationView,
        status=target,
        updated_at=now(),
        **values,
    )
    await emit(session, OPERATION_EVENTS[target], operation_state(new), actor)
    if target != op.status or message:
        await timeline(
            session,
            new.instance_id,
            f"operation.{target}",
            message or f"{new.kind} operation {new.operation_id} {target}",
            actor,
            operation_id=new.operation_id,
            member_id=new.member_id,
            attempt=new.attempt,
        )
    return new


async def cancel_open_operation(
    session: AsyncSession, op: OperationView, actor: Actor, why: str, message: str
) -> OperationView:
    """Cancel an open operation (its lease, if any, is dropped); `why` is recorded as its error."""
    return await update_operation(
        session, op, OperationStatus.cancelled, actor, message, lease_token=None, lease_expires_at=None, error=why
    )
