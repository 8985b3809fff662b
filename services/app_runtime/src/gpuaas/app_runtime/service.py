"""App-runtime use cases. Each runs in ONE transaction that writes state + outbox events + audit record
(+ timeline entries); the caller (api.py, a handler or the reconciler) owns the transaction.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import and_, func, insert, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.app_runtime import domain
from gpuaas.app_runtime.custody import KeyPair, Sealed
from gpuaas.app_runtime.domain import IS, MS, OS
from gpuaas.app_runtime.models import (
    allocations,
    controller_bindings,
    credentials,
    entitlements,
    instance_events,
    instances,
    manifests,
    members,
    operations,
    release_requests,
)
from gpuaas.contracts import Actor, Event, new_event_id
from gpuaas.contracts.events import app_runtime as ev
from gpuaas.contracts.events.app_runtime import OperationKind
from gpuaas.kit import audit, iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, Forbidden, NotFound, Unprocessable
from gpuaas.kit.outbox import add_event
from gpuaas.kit.tables import iam_service_accounts
from gpuaas.kit.versioning import check_version

SERVICE = "app_runtime"
SOURCE = "app-runtime"
SYSTEM = Actor.system("app-runtime")

STATUS_EVENTS: dict[IS, type[Event]] = {
    IS.created: ev.InstanceCreated,
    IS.starting: ev.InstanceStarting,
    IS.running: ev.InstanceRunning,
    IS.degraded: ev.InstanceDegraded,
    IS.stopping: ev.InstanceStopping,
    IS.stopped: ev.InstanceStopped,
    IS.decommissioning: ev.InstanceDecommissioning,
    IS.decommissioned: ev.InstanceDecommissioned,
    IS.decommission_failed: ev.InstanceDecommissionFailed,
    IS.failed: ev.InstanceFailed,
}
OP_EVENTS: dict[OS, type[Event]] = {
    OS.pending: ev.MemberOperationRequeued,
    OS.claimed: ev.MemberOperationClaimed,
    OS.in_progress: ev.MemberOperationProgressed,
    OS.succeeded: ev.MemberOperationSucceeded,
    OS.failed: ev.MemberOperationFailed,
    OS.cancelled: ev.MemberOperationCancelled,
}


def now() -> datetime:
    return datetime.now(UTC)


def _actor(who: Principal | Actor) -> Actor:
    return who.actor if isinstance(who, Principal) else who


# ------------------------------------------------------------------------------------------ reading


async def load_instance(session: AsyncSession, instance_id: uuid.UUID, *, lock: bool = False) -> Any:
    stmt = select(instances).where(instances.c.instance_id == instance_id)
    if lock:
        stmt = stmt.with_for_update()
    row = (await session.execute(stmt)).first()
    if row is None:
        raise NotFound("instance not found", code="instance_not_found")
    return row


async def readable_instance(session: AsyncSession, principal: Principal, instance_id: uuid.UUID) -> Any:
    row = await load_instance(session, instance_id)
    try:
        await iam.authorize(session, principal, "apps.instance.read", project_id=row.project_id)
    except NotFound:
        raise NotFound("instance not found", code="instance_not_found") from None
    return row


async def authorized_instance(
    session: AsyncSession, principal: Principal, instance_id: uuid.UUID, action: str, *, lock: bool = True
) -> Any:
    """The instance, locked, after checking `action` (404 when the caller may not even see it)."""
    row = await load_instance(session, instance_id)
    try:
        await iam.authorize(session, principal, "apps.instance.read", project_id=row.project_id)
    except NotFound:
        raise NotFound("instance not found", code="instance_not_found") from None
    await iam.authorize(session, principal, action, project_id=row.project_id)
    return await load_instance(session, instance_id, lock=lock)


async def controller_instance(
    session: AsyncSession, principal: Principal, instance_id: uuid.UUID, *, lock: bool = False
) -> Any:
    """An instance as seen by its controller: the bound service account of its project and app only."""
    row = await load_instance(session, instance_id)
    await check_controller(session, principal, row.project_id, row.app_slug)
    return await load_instance(session, instance_id, lock=True) if lock else row


async def check_controller(session: AsyncSession, principal: Principal, project_id: uuid.UUID, app_slug: str) -> None:
    if not principal.is_service_account:
        raise Forbidden("the controller API is for service accounts", code="controller_only")
    try:
        await iam.authorize(session, principal, "apps.controller", project_id=project_id)
    except NotFound:
        raise NotFound("instance not found", code="instance_not_found") from None
    bound = (
        await session.execute(
            select(controller_bindings.c.service_account_id).where(
                controller_bindings.c.project_id == project_id, controller_bindings.c.app_slug == app_slug
            )
        )
    ).scalar()
    if bound != principal.subject:
        raise Forbidden(f"this service account is not the controller of {app_slug} here", code="not_the_controller")


async def instance_state(session: AsyncSession, row: Any) -> ev.InstanceState:
    controller = (
        await session.execute(
            select(controller_bindings.c.service_account_id).where(
                controller_bindings.c.project_id == row.project_id, controller_bindings.c.app_slug == row.app_slug
            )
        )
    ).scalar()
    return ev.InstanceState(
        instance_id=row.instance_id,
        tenant_id=row.tenant_id,
        project_id=row.project_id,
        name=row.name,
        app_slug=row.app_slug,
        app_version=row.app_version,
        manifest_id=row.manifest_id,
        artifact_digest=row.artifact_digest,
        status=row.status,
        status_changed_at=row.status_changed_at,
        placement_intent=row.placement_intent,
        config=row.config,
        runtime_detail=row.runtime_detail or {},
        health=row.health or {},
        failure_reason=row.failure_reason,
        decommission=row.decommission,
        version=row.version,
        desired_manifest_id=row.desired_manifest_id,
        desired_app_version=row.desired_app_version,
        previous_manifest_id=row.previous_manifest_id,
        controller_service_account_id=controller,
    )


def member_state(row: Any) -> ev.MemberState:
    return ev.MemberState.model_validate(dict(row._mapping))


def operation_state(row: Any) -> ev.MemberOperationState:
    return ev.MemberOperationState.model_validate(dict(row._mapping))


def grant_state(row: Any, status: str = "requested") -> ev.AccessGrantState:
    return ev.AccessGrantState(
        access_grant_id=row.credential_id,
        instance_id=row.instance_id,
        tenant_id=row.tenant_id,
        project_id=row.project_id,
        allocation_ids=row.allocation_ids,
        public_key=row.public_key,
        fingerprint=row.fingerprint,
        status=status,
        rotated_from=row.rotated_from,
        version=row.version,
    )


# ------------------------------------------------------------------------------------------ writing helpers


async def timeline(
    session: AsyncSession, instance_id: uuid.UUID, kind: str, message: str, actor: Actor, **data: Any
) -> None:
    await session.execute(
        insert(instance_events).values(
            instance_id=instance_id, kind=kind, message=message, data=_jsonable(data), actor=f"{actor.kind}:{actor.id}"
        )
    )
    await session.execute(func.pg_notify("app_runtime_timeline", str(instance_id)).select())


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


async def emit_instance(session: AsyncSession, row: Any, event_cls: type[Event], actor: Actor) -> None:
    await add_event(session, event_cls.build(data=await instance_state(session, row), source=SOURCE, actor=actor))


async def update_instance(session: AsyncSession, instance_id: uuid.UUID, actor: Actor, **values: Any) -> Any:
    """Change fields (not status) and emit `instance.updated`."""
    row = (
        await session.execute(
            update(instances)
            .where(instances.c.instance_id == instance_id)
            .values(**values, version=instances.c.version + 1)
            .returning(*instances.c)
        )
    ).one()
    await emit_instance(session, row, ev.InstanceUpdated, actor)
    return row


async def set_instance_status(
    session: AsyncSession, row: Any, target: IS, actor: Actor, message: str = "", **values: Any
) -> Any:
    domain.check_instance_transition(row.status, target)
    new = (
        await session.execute(
            update(instances)
            .where(instances.c.instance_id == row.instance_id)
            .values(status=target, status_changed_at=now(), version=instances.c.version + 1, **values)
            .returning(*instances.c)
        )
    ).one()
    await emit_instance(session, new, STATUS_EVENTS[target], actor)
    await timeline(
        session, row.instance_id, f"instance.{target}", message or f"instance is {target}", actor, previous=row.status
    )
    return new


async def insert_member(
    session: AsyncSession, inst: Any, component_key: str, allocation_id: uuid.UUID, op_id: uuid.UUID, actor: Actor
) -> Any:
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
                status=MS.pending,
                last_operation_id=op_id,
                version=1,
            )
            .returning(*members.c)
        )
    ).one()
    await add_event(session, ev.MemberAdded.build(data=member_state(row), source=SOURCE, actor=actor))
    await timeline(
        session,
        inst.instance_id,
        "member.added",
        f"{component_key} member on allocation {allocation_id}",
        actor,
        member_id=row.member_id,
        allocation_id=allocation_id,
    )
    return row


async def update_member(session: AsyncSession, member_id: uuid.UUID, actor: Actor, **values: Any) -> Any:
    if "status" in values:
        values["status_changed_at"] = now()
    row = (
        await session.execute(
            update(members)
            .where(members.c.member_id == member_id)
            .values(**values, version=members.c.version + 1)
            .returning(*members.c)
        )
    ).one()
    cls = ev.MemberTombstoned if values.get("tombstoned") else ev.MemberUpdated
    await add_event(session, cls.build(data=member_state(row), source=SOURCE, actor=actor))
    if "status" in values or values.get("tombstoned"):
        what = "tombstoned" if values.get("tombstoned") else values["status"]
        await timeline(
            session,
            row.instance_id,
            f"member.{what}",
            f"{row.component_key} member {member_id} {what}"
            + (f": {row.tombstone_reason}" if values.get("tombstoned") else ""),
            actor,
            member_id=member_id,
        )
    return row


async def insert_operation(
    session: AsyncSession,
    inst: Any,
    kind: OperationKind,
    actor: Actor,
    *,
    member: Any = None,
    allocation_id: uuid.UUID | None = None,
    component_key: str | None = None,
    params: dict[str, Any] | None = None,
) -> Any:
    op_id = new_event_id()
    await session.execute(
        insert(operations).values(
            operation_id=op_id,
            instance_id=inst.instance_id,
            tenant_id=inst.tenant_id,
            project_id=inst.project_id,
            app_slug=inst.app_slug,
            kind=kind,
            status=OS.pending,
            member_id=member.member_id if member is not None else None,
            component_key=component_key or (member.component_key if member is not None else None),
            allocation_id=allocation_id or (member.allocation_id if member is not None else None),
            params=params or {},
            version=1,
        )
    )
    result_member = None
    if (
        kind is OperationKind.add
        or kind is OperationKind.replace
        or (kind is OperationKind.recover and member is not None and member.status == MS.failed)
    ):
        # the member this operation brings up (a failed member is replaced by a new one: it stays a tombstone)
        key = component_key or member.component_key
        target_alloc = allocation_id or member.allocation_id
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
    row = (await session.execute(select(operations).where(operations.c.operation_id == op_id))).one()
    await add_event(session, ev.MemberOperationCreated.build(data=operation_state(row), source=SOURCE, actor=actor))
    await timeline(
        session,
        inst.instance_id,
        "operation.created",
        f"{kind} operation {op_id} pending",
        actor,
        operation_id=op_id,
        member_id=row.member_id,
    )
    return row


async def update_operation(
    session: AsyncSession, op: Any, target: OS, actor: Actor, message: str = "", **values: Any
) -> Any:
    domain.check_operation_transition(op.status, target)
    row = (
        await session.execute(
            update(operations)
            .where(operations.c.operation_id == op.operation_id)
            .values(status=target, updated_at=now(), version=operations.c.version + 1, **values)
            .returning(*operations.c)
        )
    ).one()
    await add_event(session, OP_EVENTS[target].build(data=operation_state(row), source=SOURCE, actor=actor))
    if target != op.status or message:
        await timeline(
            session,
            row.instance_id,
            f"operation.{target}",
            message or f"{row.kind} operation {row.operation_id} {target}",
            actor,
            operation_id=row.operation_id,
            member_id=row.member_id,
            attempt=row.attempt,
        )
    return row


async def live_members(session: AsyncSession, instance_id: uuid.UUID) -> list[Any]:
    return list(
        (
            await session.execute(
                select(members)
                .where(members.c.instance_id == instance_id, members.c.tombstoned.is_(False))
                .order_by(members.c.created_at, members.c.member_id)
            )
        ).all()
    )


async def sync_grant(session: AsyncSession, instance_id: uuid.UUID, actor: Actor) -> None:
    """Keep the access grant's allocations equal to the allocations of the live members."""
    cred = (
        await session.execute(
            select(credentials)
            .where(credentials.c.instance_id == instance_id, credentials.c.status == "active")
            .with_for_update()
        )
    ).first()
    if cred is None:
        return
    wanted = sorted({str(m.allocation_id) for m in await live_members(session, instance_id)})
    if wanted == sorted(cred.allocation_ids):
        return
    row = (
        await session.execute(
            update(credentials)
            .where(credentials.c.credential_id == cred.credential_id)
            .values(allocation_ids=wanted, version=credentials.c.version + 1)
            .returning(*credentials.c)
        )
    ).one()
    await add_event(session, ev.AccessGrantUpdated.build(data=grant_state(row), source=SOURCE, actor=actor))


async def revoke_credentials(session: AsyncSession, instance_id: uuid.UUID, actor: Actor) -> None:
    rows = (
        await session.execute(
            update(credentials)
            .where(credentials.c.instance_id == instance_id, credentials.c.status == "active")
            .values(status="revoked", revoked_at=now(), version=credentials.c.version + 1)
            .returning(*credentials.c)
        )
    ).all()
    for row in rows:
        await add_event(
            session, ev.AccessGrantRevoked.build(data=grant_state(row, "revoked"), source=SOURCE, actor=actor)
        )
        await timeline(
            session,
            instance_id,
            "credential.revoked",
            f"access credential {row.fingerprint} revoked",
            actor,
            credential_id=row.credential_id,
        )


async def recompute_instance(session: AsyncSession, instance_id: uuid.UUID, actor: Actor) -> Any:
    inst = await load_instance(session, instance_id, lock=True)
    statuses = [m.status for m in await live_members(session, instance_id)]
    target = domain.derive_instance_status(inst.status, statuses)
    if target != inst.status:
        return await set_instance_status(session, inst, target, actor, f"members: {', '.join(statuses) or 'none'}")
    return inst


# ------------------------------------------------------------------------------------------ controller bindings


async def bind_controller(
    session: AsyncSession, principal: Principal, project_id: uuid.UUID, app_slug: str, service_account_id: uuid.UUID
) -> Any:
    await iam.authorize(session, principal, "apps.instance.manage", project_id=project_id)
    sa = (
        await session.execute(
            select(iam_service_accounts).where(iam_service_accounts.c.service_account_id == service_account_id)
        )
    ).first()
    if sa is None or sa.project_id != project_id or sa.disabled:
        raise Unprocessable("no active service account with this id in this project", code="service_account_invalid")
    if "app-controller" not in (sa.scopes or []):
        raise Unprocessable("the service account lacks the app-controller scope", code="service_account_invalid")
    tenant_id = await iam.project_tenant(session, project_id)
    before = (
        await session.execute(
            select(controller_bindings).where(
                controller_bindings.c.project_id == project_id, controller_bindings.c.app_slug == app_slug
            )
        )
    ).first()
    stmt = pg_insert(controller_bindings).values(
        binding_id=new_event_id(),
        tenant_id=tenant_id,
        project_id=project_id,
        app_slug=app_slug,
        service_account_id=service_account_id,
    )
    stmt = stmt.on_conflict_do_update(
        constraint="uq_controller_bindings_project_app", set_={"service_account_id": service_account_id}
    ).returning(*controller_bindings.c)
    row = (await session.execute(stmt)).one()
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="apps.controller.bind",
        resource_type="controller_binding",
        resource_id=row.binding_id,
        tenant_id=tenant_id,
        project_id=project_id,
        before={"service_account_id": str(before.service_account_id)} if before else None,
        after={"app_slug": app_slug, "service_account_id": str(service_account_id)},
    )
    return row


# ------------------------------------------------------------------------------------------ deploy


async def find_manifest(session: AsyncSession, app_slug: str, app_version: str | None) -> Any:
    stmt = select(manifests).where(manifests.c.slug == app_slug)
    if app_version is not None:
        stmt = stmt.where(manifests.c.app_version == app_version)
    else:
        stmt = stmt.where(manifests.c.active.is_(True), manifests.c.deprecated.is_(False))
    rows = (await session.execute(stmt)).all()
    row = max(rows, key=lambda r: domain.version_key(r.app_version)) if rows else None
    if row is None:
        what = f"{app_slug} {app_version}" if app_version else f"an active version of {app_slug}"
        raise NotFound(f"no app manifest for {what}", code="app_not_found")
    return row


async def check_deployable(session: AsyncSession, tenant_id: uuid.UUID, manifest: Any) -> None:
    entitled = (
        await session.execute(
            select(entitlements.c.entitlement_id).where(
                entitlements.c.tenant_id == tenant_id,
                entitlements.c.app_slug == manifest.slug,
                entitlements.c.status == "granted",
            )
        )
    ).first()
    if entitled is None:
        raise Forbidden(f"this tenant is not entitled to {manifest.slug}", code="app_not_entitled")
    if manifest.deprecated:
        raise Conflict(
            f"{manifest.slug} {manifest.app_version} is deprecated; choose a newer version", code="app_deprecated"
        )
    if not manifest.active:
        raise Conflict(f"{manifest.slug} {manifest.app_version} is not active", code="app_not_active")


async def allocation_views(session: AsyncSession, ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, domain.AllocationView]:
    rows = (await session.execute(select(allocations).where(allocations.c.allocation_id.in_(list(ids))))).all()
    return {
        r.allocation_id: domain.AllocationView(r.allocation_id, r.project_id, r.status, r.shape, r.gpu_count)
        for r in rows
    }


async def deploy(
    session: AsyncSession,
    principal: Principal,
    project_id: uuid.UUID,
    *,
    name: str,
    app_slug: str,
    app_version: str | None,
    config: dict[str, Any],
    placement: ev.PlacementIntent,
    credential_id: uuid.UUID,
    key_pair: KeyPair,
    sealed: Sealed,
) -> Any:
    await iam.authorize(session, principal, "apps.instance.deploy", project_id=project_id)
    tenant_id = await iam.project_tenant(session, project_id)
    assert tenant_id is not None
    manifest = await find_manifest(session, app_slug, app_version)
    await check_deployable(session, tenant_id, manifest)
    state = manifest.state
    compatibility = state.get("compatibility") or {}
    ids = [i for i in [placement.controller_allocation_id, *placement.worker_allocation_ids] if i is not None]
    domain.check_placement(
        project_id=project_id,
        mode=placement.mode,
        controller_allocation_id=placement.controller_allocation_id,
        worker_allocation_ids=placement.worker_allocation_ids,
        allocations=await allocation_views(session, ids),
        compatibility=compatibility,
    )
    domain.validate_config(state.get("inputs") or {"type": "object"}, config)
    digest = manifest.artifact_ref.split("@", 1)[1]
    actor = principal.actor
    inst = (
        await session.execute(
            insert(instances)
            .values(
                instance_id=new_event_id(),
                tenant_id=tenant_id,
                project_id=project_id,
                name=name,
                app_slug=manifest.slug,
                app_version=manifest.app_version,
                manifest_id=manifest.manifest_id,
                artifact_digest=digest,
                status=IS.created,
                placement_intent=placement.model_dump(mode="json"),
                config=config,
                runtime_detail={},
                health=ev.InstanceHealth().model_dump(mode="json"),
                version=1,
            )
            .returning(*instances.c)
        )
    ).one()
    await emit_instance(session, inst, ev.InstanceCreated, actor)
    await timeline(
        session, inst.instance_id, "instance.created", f"deployed {manifest.slug} {manifest.app_version}", actor
    )
    controller_key, worker_key = domain.component_keys(state.get("roles") or [])
    await insert_operation(
        session,
        inst,
        OperationKind.add,
        actor,
        allocation_id=placement.controller_allocation_id,
        component_key=controller_key,
    )
    for worker in placement.worker_allocation_ids:
        await insert_operation(session, inst, OperationKind.add, actor, allocation_id=worker, component_key=worker_key)
    alloc_ids = sorted({str(i) for i in ids})
    cred = (
        await session.execute(
            insert(credentials)
            .values(
                credential_id=credential_id,
                instance_id=inst.instance_id,
                tenant_id=tenant_id,
                project_id=project_id,
                public_key=key_pair.public_openssh,
                fingerprint=key_pair.fingerprint,
                status="active",
                allocation_ids=alloc_ids,
                version=1,
                **sealed.columns(),
            )
            .returning(*credentials.c)
        )
    ).one()
    await add_event(session, ev.AccessGrantRequested.build(data=grant_state(cred), source=SOURCE, actor=actor))
    await timeline(
        session,
        inst.instance_id,
        "credential.issued",
        f"access credential {cred.fingerprint} issued",
        actor,
        credential_id=credential_id,
    )
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="apps.instance.deploy",
        resource_type="app_instance",
        resource_id=inst.instance_id,
        tenant_id=tenant_id,
        project_id=project_id,
        after={
            "app": manifest.slug,
            "version": manifest.app_version,
            "placement": placement.model_dump(mode="json"),
            "credential_fingerprint": cred.fingerprint,
        },
    )
    return inst


# ------------------------------------------------------------------------------------------ operations


async def request_operation(
    session: AsyncSession,
    principal: Principal,
    instance_id: uuid.UUID,
    kind: OperationKind,
    *,
    member_id: uuid.UUID | None,
    allocation_id: uuid.UUID | None,
    component_key: str | None,
    params: dict[str, Any],
    expected_version: int | None = None,
) -> Any:
    """A user (apps.member.add / apps.operation.manage) or the instance's controller asks for an operation.

    A request changes the instance (its members and their operations), so it moves the instance's version:
    of two requests based on the same version (`expected_version`, If-Match) only the first goes through."""
    if principal.is_service_account:
        inst = await controller_instance(session, principal, instance_id, lock=True)
    else:
        action = "apps.member.add" if kind is OperationKind.add else "apps.operation.manage"
        inst = await authorized_instance(session, principal, instance_id, action)
    check_version(inst.version, expected_version)
    if inst.status not in domain.LIVE_INSTANCE:
        raise Conflict(f"the instance is {inst.status}; operations need a live instance", code="instance_not_live")
    member = None
    if kind in domain.NEEDS_MEMBER:
        if member_id is None:
            raise Unprocessable(f"a {kind} operation needs member_id", code="member_required")
        member = (
            await session.execute(
                select(members)
                .where(members.c.member_id == member_id, members.c.instance_id == instance_id)
                .with_for_update()
            )
        ).first()
        if member is None:
            raise NotFound("member not found", code="member_not_found")
        if member.tombstoned:
            raise Conflict("the member is a tombstone", code="member_tombstoned")
        busy = (
            await session.execute(
                select(operations.c.operation_id).where(
                    or_(operations.c.member_id == member_id, operations.c.result_member_id == member_id),
                    operations.c.status.in_([s.value for s in domain.OPEN_OPS]),
                )
            )
        ).first()
        if busy is not None:
            raise Conflict(f"operation {busy[0]} is still open on this member", code="operation_in_flight")
    manifest = (await session.execute(select(manifests).where(manifests.c.manifest_id == inst.manifest_id))).one()
    compatibility = manifest.state.get("compatibility") or {}
    if kind in (OperationKind.add, OperationKind.replace):
        if allocation_id is None:
            raise Unprocessable(f"a {kind} operation needs allocation_id", code="allocation_required")
        views = await allocation_views(session, [allocation_id])
        domain.check_allocation(allocation_id, inst.project_id, views.get(allocation_id), compatibility)
        others = {m.allocation_id for m in await live_members(session, instance_id)}
        if allocation_id not in others and others and not compatibility.get("multi_allocation", False):
            raise Unprocessable("this app does not span several allocations", code="incompatible_multi_allocation")
        if kind is OperationKind.add and not component_key:
            component_key = domain.component_keys(manifest.state.get("roles") or [])[1]
    else:
        allocation_id = None
    op = await insert_operation(
        session,
        inst,
        kind,
        principal.actor,
        member=member,
        allocation_id=allocation_id,
        component_key=component_key,
        params=params,
    )
    await update_instance(session, instance_id, principal.actor)
    await sync_grant(session, instance_id, principal.actor)
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action=f"apps.operation.{kind}",
        resource_type="member_operation",
        resource_id=op.operation_id,
        tenant_id=inst.tenant_id,
        project_id=inst.project_id,
        after={
            "instance_id": str(instance_id),
            "member_id": str(op.member_id) if op.member_id else None,
            "allocation_id": str(op.allocation_id) if op.allocation_id else None,
        },
    )
    return op


async def controller_operations(
    session: AsyncSession, principal: Principal, project_id: uuid.UUID, app_slug: str, statuses: Sequence[str]
) -> list[Any]:
    await check_controller(session, principal, project_id, app_slug)
    stmt = select(operations).where(operations.c.project_id == project_id, operations.c.app_slug == app_slug)
    if statuses:
        stmt = stmt.where(operations.c.status.in_(list(statuses)))
    return list((await session.execute(stmt.order_by(operations.c.operation_id))).all())


def _claimable(at: datetime) -> Any:
    return or_(
        operations.c.status == OS.pending,
        and_(operations.c.status.in_([OS.claimed, OS.in_progress]), operations.c.lease_expires_at < at),
    )


async def claim(
    session: AsyncSession,
    principal: Principal,
    *,
    project_id: uuid.UUID,
    app_slug: str,
    operation_id: uuid.UUID | None,
    lease_s: int,
    holder: str | None,
) -> tuple[Any, uuid.UUID] | None:
    """Claim one operation (a given one, or the oldest claimable of the app) with a lease.

    A pending operation, or one whose lease has expired, can be claimed; concurrent claimers are
    serialised by the row lock (`SKIP LOCKED` for claim-next), so exactly one gets it.
    """
    await check_controller(session, principal, project_id, app_slug)
    at = now()
    stmt = select(operations).where(
        operations.c.project_id == project_id, operations.c.app_slug == app_slug, _claimable(at)
    )
    if operation_id is not None:
        stmt = stmt.where(operations.c.operation_id == operation_id).with_for_update()
    else:
        # Operations on instances that are not being torn down first; oldest first.
        stmt = stmt.order_by(operations.c.operation_id).limit(1).with_for_update(skip_locked=True)
    op = (await session.execute(stmt)).first()
    if op is None:
        if operation_id is not None:
            exists = (
                await session.execute(
                    select(operations.c.status).where(
                        operations.c.operation_id == operation_id,
                        operations.c.project_id == project_id,
                        operations.c.app_slug == app_slug,
                    )
                )
            ).first()
            if exists is None:
                raise NotFound("operation not found", code="operation_not_found")
            raise Conflict(
                f"the operation is {exists[0]} and its lease (if any) is live", code="operation_not_claimable"
            )
        return None
    token = uuid.uuid4()
    expired = op.status != OS.pending
    actor = principal.actor
    if expired:  # the previous holder lost it: record the requeue, then the new claim
        op = await update_operation(
            session,
            op,
            OS.pending,
            actor,
            f"lease of {op.claimed_by} expired; operation requeued",
            lease_token=None,
            lease_expires_at=None,
            claimed_by=None,
        )
    claimed_by = f"{principal.subject}" + (f"/{holder}" if holder else "")
    op = await update_operation(
        session,
        op,
        OS.claimed,
        actor,
        f"{op.kind} operation claimed by {claimed_by} (attempt {op.attempt + 1})",
        claimed_by=claimed_by,
        lease_token=token,
        lease_expires_at=at + timedelta(seconds=lease_s),
        attempt=op.attempt + 1,
    )
    target = op.result_member_id if op.kind in ("add", "replace") or op.result_member_id else op.member_id
    member_status = {
        "add": MS.starting,
        "replace": MS.starting,
        "recover": MS.starting,
        "drain": MS.draining,
        "remove": MS.stopping,
    }[op.kind]
    if target is not None:
        await update_member(session, target, actor, status=member_status, last_operation_id=op.operation_id)
        await recompute_instance(session, op.instance_id, actor)
    return op, token


async def _held_operation(
    session: AsyncSession, principal: Principal, operation_id: uuid.UUID, lease_token: uuid.UUID
) -> Any:
    op = (
        await session.execute(select(operations).where(operations.c.operation_id == operation_id).with_for_update())
    ).first()
    if op is None:
        raise NotFound("operation not found", code="operation_not_found")
    await check_controller(session, principal, op.project_id, op.app_slug)
    if op.lease_token != lease_token or op.status not in (OS.claimed, OS.in_progress):
        raise Conflict(
            "this lease is no longer held (expired, requeued or finished)", code="lease_lost", status_now=op.status
        )
    if op.lease_expires_at is not None and op.lease_expires_at < now():
        raise Conflict("the lease expired", code="lease_lost", status_now=op.status)
    return op


async def heartbeat(
    session: AsyncSession,
    principal: Principal,
    operation_id: uuid.UUID,
    lease_token: uuid.UUID,
    *,
    lease_s: int,
    message: str | None,
    percent: int | None,
) -> Any:
    op = await _held_operation(session, principal, operation_id, lease_token)
    values: dict[str, Any] = {"lease_expires_at": now() + timedelta(seconds=lease_s)}
    if message is not None:
        values["progress_message"] = message
    if percent is not None:
        values["progress_percent"] = percent
    return await update_operation(
        session,
        op,
        OS.in_progress,
        principal.actor,
        (message and f"{op.kind} {operation_id}: {message}") or "",
        **values,
    )


async def complete(
    session: AsyncSession,
    principal: Principal,
    operation_id: uuid.UUID,
    lease_token: uuid.UUID,
    result: dict[str, Any],
    member_detail: dict[str, Any] | None,
) -> Any:
    op = await _held_operation(session, principal, operation_id, lease_token)
    actor = principal.actor
    op = await update_operation(
        session, op, OS.succeeded, actor, lease_token=None, lease_expires_at=None, result=result, progress_percent=100
    )
    detail = {"detail": member_detail} if member_detail is not None else {}
    if op.kind in ("add", "replace") or (op.kind == "recover" and op.result_member_id):
        await update_member(session, op.result_member_id, actor, status=MS.active, **detail)
        if op.kind != "add":
            await update_member(
                session,
                op.member_id,
                actor,
                # a recovered member failed: its tombstone keeps saying so
                status=MS.failed if op.kind == "recover" else MS.removed,
                tombstoned=True,
                tombstone_reason=f"replaced by member {op.result_member_id} ({op.kind} {op.operation_id})",
            )
    elif op.kind == "recover":
        await update_member(session, op.member_id, actor, status=MS.active, **detail)
    elif op.kind == "drain":
        await update_member(session, op.member_id, actor, status=MS.stopped, **detail)
    elif op.kind == "remove":
        verified = result.get("teardown_verified") is True
        await update_member(
            session,
            op.member_id,
            actor,
            status=MS.removed,
            tombstoned=True,
            tombstone_reason=f"removed by {op.operation_id}" + ("" if verified else " (teardown not verified)"),
            **detail,
        )
    await after_operation(session, op, actor)
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="apps.operation.complete",
        resource_type="member_operation",
        resource_id=op.operation_id,
        tenant_id=op.tenant_id,
        project_id=op.project_id,
        after={"status": op.status, "result": result},
    )
    return op


async def fail(
    session: AsyncSession,
    principal: Principal | Actor,
    op: Any,
    error: str,
    *,
    forced: bool = False,
    message: str = "",
) -> Any:
    actor = _actor(principal)
    op = await update_operation(
        session,
        op,
        OS.failed,
        actor,
        message or f"{op.kind} {op.operation_id} failed: {error}",
        lease_token=None,
        lease_expires_at=None,
        error=error,
        forced=forced,
    )
    await _member_after_failure(session, op, actor, error)
    await after_operation(session, op, actor)
    return op


async def _member_after_failure(session: AsyncSession, op: Any, actor: Actor, error: str) -> None:
    if op.kind in ("replace", "recover") and op.result_member_id:
        await update_member(
            session,
            op.result_member_id,
            actor,
            status=MS.failed,
            tombstoned=True,
            tombstone_reason=f"{op.kind} {op.operation_id} failed: {error}",
        )
        return
    target = op.member_id
    if target is None:
        return
    m = (await session.execute(select(members).where(members.c.member_id == target))).one()
    if not m.tombstoned:
        await update_member(session, target, actor, status=MS.failed, detail={**(m.detail or {}), "error": error})


async def controller_fail(
    session: AsyncSession, principal: Principal, operation_id: uuid.UUID, lease_token: uuid.UUID, error: str
) -> Any:
    op = await _held_operation(session, principal, operation_id, lease_token)
    op = await fail(session, principal, op, error)
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="apps.operation.fail",
        resource_type="member_operation",
        resource_id=op.operation_id,
        tenant_id=op.tenant_id,
        project_id=op.project_id,
        after={"error": error},
    )
    return op


async def after_operation(session: AsyncSession, op: Any, actor: Actor) -> None:
    """Everything an operation's outcome drives: instance status, decommission and stop progress,
    release clearances, the access grant's allocations."""
    inst = await load_instance(session, op.instance_id, lock=True)
    if inst.status in domain.LIVE_INSTANCE:
        await recompute_instance(session, op.instance_id, actor)
    elif inst.status == IS.decommissioning:
        await check_decommission(session, op.instance_id, actor)
    elif inst.status == IS.stopping:
        await check_stopped(session, op.instance_id, actor)
    if op.allocation_id is not None:
        await check_release(session, op.allocation_id, actor)
    await sync_grant(session, op.instance_id, actor)


# ------------------------------------------------------------------------------------------ operator actions


async def _operation_for_operator(
    session: AsyncSession, principal: Principal, operation_id: uuid.UUID, expected_version: int | None
) -> Any:
    """The operation, locked, after checking `apps.operation.manage` and the version the caller read."""
    op = (
        await session.execute(select(operations).where(operations.c.operation_id == operation_id).with_for_update())
    ).first()
    if op is None:
        raise NotFound("operation not found", code="operation_not_found")
    try:
        await iam.authorize(session, principal, "apps.instance.read", project_id=op.project_id)
    except NotFound:
        raise NotFound("operation not found", code="operation_not_found") from None
    await iam.authorize(session, principal, "apps.operation.manage", project_id=op.project_id)
    check_version(op.version, expected_version)
    return op


async def retry_operation(
    session: AsyncSession,
    principal: Principal,
    operation_id: uuid.UUID,
    reason: str,
    *,
    expected_version: int | None = None,
) -> Any:
    op = await _operation_for_operator(session, principal, operation_id, expected_version)
    if op.status not in (OS.failed, OS.cancelled, OS.claimed, OS.in_progress):
        raise Conflict(f"a {op.status} operation cannot be retried", code="invalid_operation_transition")
    inst = await load_instance(session, op.instance_id, lock=True)
    if inst.status in (IS.decommissioned,):
        raise Conflict("the instance is decommissioned", code="instance_not_live")
    if op.result_member_id and op.kind in ("replace", "recover") and op.status in (OS.failed, OS.cancelled):
        raise Conflict(
            f"request a new {op.kind} operation: this one's member is a tombstone", code="operation_not_retryable"
        )
    before = op.status
    op = await update_operation(
        session,
        op,
        OS.pending,
        principal.actor,
        f"operator retried {op.kind} {operation_id} ({reason})",
        lease_token=None,
        lease_expires_at=None,
        claimed_by=None,
        error=None,
        forced=False,
    )
    target = op.member_id
    if target is not None:
        m = (await session.execute(select(members).where(members.c.member_id == target))).one()
        if not m.tombstoned and m.status == MS.failed and op.kind == "add":
            await update_member(session, target, principal.actor, status=MS.pending)
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="apps.operation.retry",
        resource_type="member_operation",
        resource_id=op.operation_id,
        tenant_id=op.tenant_id,
        project_id=op.project_id,
        before={"status": before},
        after={"status": op.status},
        reason=reason,
    )
    return op


async def cancel_operation(
    session: AsyncSession,
    principal: Principal,
    operation_id: uuid.UUID,
    reason: str,
    *,
    expected_version: int | None = None,
) -> Any:
    op = await _operation_for_operator(session, principal, operation_id, expected_version)
    if op.status not in domain.OPEN_OPS:
        raise Conflict(f"a {op.status} operation cannot be cancelled", code="invalid_operation_transition")
    before = op.status
    op = await update_operation(
        session,
        op,
        OS.cancelled,
        principal.actor,
        f"operator cancelled {op.kind} {operation_id} ({reason})",
        lease_token=None,
        lease_expires_at=None,
        error=reason,
    )
    if op.kind == "add" and op.member_id:
        await update_member(
            session,
            op.member_id,
            principal.actor,
            status=MS.removed,
            tombstoned=True,
            tombstone_reason=f"add {op.operation_id} cancelled: {reason}",
        )
    elif op.result_member_id:
        await update_member(
            session,
            op.result_member_id,
            principal.actor,
            status=MS.removed,
            tombstoned=True,
            tombstone_reason=f"{op.kind} {op.operation_id} cancelled: {reason}",
        )
    await after_operation(session, op, principal.actor)
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="apps.operation.cancel",
        resource_type="member_operation",
        resource_id=op.operation_id,
        tenant_id=op.tenant_id,
        project_id=op.project_id,
        before={"status": before},
        after={"status": op.status},
        reason=reason,
    )
    return op


async def force_fail_operation(
    session: AsyncSession,
    principal: Principal,
    operation_id: uuid.UUID,
    reason: str,
    *,
    expected_version: int | None = None,
) -> Any:
    op = await _operation_for_operator(session, principal, operation_id, expected_version)
    if op.status not in domain.OPEN_OPS:
        raise Conflict(f"a {op.status} operation cannot be force-failed", code="invalid_operation_transition")
    before = op.status
    op = await fail(
        session,
        principal,
        op,
        f"forced by operator: {reason}",
        forced=True,
        message=f"operator force-failed {op.kind} {operation_id} ({reason})",
    )
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="apps.operation.force_fail",
        resource_type="member_operation",
        resource_id=op.operation_id,
        tenant_id=op.tenant_id,
        project_id=op.project_id,
        before={"status": before},
        after={"status": op.status, "forced": True},
        reason=reason,
    )
    return op


# ------------------------------------------------------------------------------------------ instance lifecycle


async def report_instance(
    session: AsyncSession,
    principal: Principal,
    instance_id: uuid.UUID,
    *,
    status: str | None,
    health: dict[str, Any] | None,
    runtime_detail: dict[str, Any] | None,
    app_version: str | None,
) -> Any:
    inst = await controller_instance(session, principal, instance_id, lock=True)
    if inst.status in (IS.decommissioned,):
        raise Conflict("the instance is decommissioned", code="instance_not_live")
    actor = principal.actor
    values: dict[str, Any] = {}
    if health is not None:
        values["health"] = ev.InstanceHealth.model_validate({**health, "checked_at": now()}).model_dump(mode="json")
    if runtime_detail is not None:
        values["runtime_detail"] = runtime_detail
    if app_version is not None:
        if app_version != inst.desired_app_version:
            raise Conflict(f"no rollout to {app_version} was requested", code="version_not_desired")
        target = (
            await session.execute(select(manifests).where(manifests.c.manifest_id == inst.desired_manifest_id))
        ).one()
        values |= {
            "previous_manifest_id": inst.manifest_id,
            "manifest_id": target.manifest_id,
            "app_version": target.app_version,
            "artifact_digest": target.artifact_ref.split("@", 1)[1],
            "desired_manifest_id": None,
            "desired_app_version": None,
        }
        await timeline(
            session, instance_id, "instance.version", f"now running {app_version} (was {inst.app_version})", actor
        )
    if values:
        inst = await update_instance(session, instance_id, actor, **values)
    if status is not None and status != inst.status:
        if status not in (IS.running, IS.degraded, IS.failed):
            raise Unprocessable("a controller reports running, degraded or failed", code="invalid_status")
        if inst.status not in domain.LIVE_INSTANCE:
            raise Conflict(f"the instance is {inst.status}", code="invalid_instance_transition")
        reason = (health or {}).get("message") or ""
        inst = await set_instance_status(
            session,
            inst,
            IS(status),
            actor,
            f"controller reported {status} {reason}",
            failure_reason=reason if status == IS.failed else None,
        )
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="apps.instance.report",
        resource_type="app_instance",
        resource_id=instance_id,
        tenant_id=inst.tenant_id,
        project_id=inst.project_id,
        after={"status": inst.status, "app_version": inst.app_version, "health": (health or {}).get("status")},
    )
    return inst


async def report_member(
    session: AsyncSession,
    principal: Principal,
    member_id: uuid.UUID,
    *,
    status: str | None,
    detail: dict[str, Any] | None,
) -> Any:
    m = (await session.execute(select(members).where(members.c.member_id == member_id).with_for_update())).first()
    if m is None:
        raise NotFound("member not found", code="member_not_found")
    await controller_instance(session, principal, m.instance_id)
    if m.tombstoned:
        raise Conflict("the member is a tombstone", code="member_tombstoned")
    values: dict[str, Any] = {}
    if detail is not None:
        values["detail"] = detail
    if status is not None and status != m.status:
        if status not in (MS.active, MS.failed):
            raise Unprocessable(
                "a controller reports a member active or failed (operations do the rest)", code="invalid_status"
            )
        values["status"] = status
    if values:
        m = await update_member(session, member_id, principal.actor, **values)
        inst = await load_instance(session, m.instance_id, lock=True)
        if inst.status in domain.LIVE_INSTANCE:
            await recompute_instance(session, m.instance_id, principal.actor)
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="apps.member.report",
        resource_type="app_member",
        resource_id=member_id,
        tenant_id=m.tenant_id,
        project_id=m.project_id,
        after={"status": m.status},
    )
    return m


async def _cancel_open(session: AsyncSession, instance_id: uuid.UUID, actor: Actor, why: str) -> None:
    rows = (
        await session.execute(
            select(operations)
            .where(operations.c.instance_id == instance_id, operations.c.status.in_([s.value for s in domain.OPEN_OPS]))
            .with_for_update()
        )
    ).all()
    for op in rows:
        await update_operation(
            session,
            op,
            OS.cancelled,
            actor,
            f"{op.kind} {op.operation_id} cancelled: {why}",
            lease_token=None,
            lease_expires_at=None,
            error=why,
        )
        if op.kind == "add" and op.member_id:
            m = (await session.execute(select(members).where(members.c.member_id == op.member_id))).one()
            if m.status == MS.pending:
                await update_member(
                    session,
                    op.member_id,
                    actor,
                    status=MS.removed,
                    tombstoned=True,
                    tombstone_reason=f"add cancelled: {why}",
                )


async def stop(
    session: AsyncSession, principal: Principal, instance_id: uuid.UUID, *, expected_version: int | None = None
) -> Any:
    inst = await authorized_instance(session, principal, instance_id, "apps.instance.manage")
    check_version(inst.version, expected_version)
    if inst.status not in (IS.created, IS.starting, IS.running, IS.degraded):
        raise Conflict(f"an instance that is {inst.status} cannot be stopped", code="invalid_instance_transition")
    actor = principal.actor
    await _cancel_open(session, instance_id, actor, "instance stopping")
    inst = await set_instance_status(session, inst, IS.stopping, actor, "stop requested")
    for m in await live_members(session, instance_id):
        if m.status not in (MS.stopped, MS.removed):
            await insert_operation(session, inst, OperationKind.drain, actor, member=m, params={"stop": True})
    await check_stopped(session, instance_id, actor)
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="apps.instance.stop",
        resource_type="app_instance",
        resource_id=instance_id,
        tenant_id=inst.tenant_id,
        project_id=inst.project_id,
        after={"status": "stopping"},
    )
    return await load_instance(session, instance_id)


async def check_stopped(session: AsyncSession, instance_id: uuid.UUID, actor: Actor) -> None:
    inst = await load_instance(session, instance_id, lock=True)
    if inst.status != IS.stopping:
        return
    open_ops = (
        await session.execute(
            select(func.count()).where(
                operations.c.instance_id == instance_id, operations.c.status.in_([s.value for s in domain.OPEN_OPS])
            )
        )
    ).scalar_one()
    if open_ops == 0:
        await set_instance_status(session, inst, IS.stopped, actor, "every member drained")


async def start(
    session: AsyncSession, principal: Principal, instance_id: uuid.UUID, *, expected_version: int | None = None
) -> Any:
    inst = await authorized_instance(session, principal, instance_id, "apps.instance.manage")
    check_version(inst.version, expected_version)
    if inst.status not in (IS.stopped, IS.failed):
        raise Conflict(f"an instance that is {inst.status} cannot be started", code="invalid_instance_transition")
    actor = principal.actor
    inst = await set_instance_status(session, inst, IS.starting, actor, "start requested")
    for m in await live_members(session, instance_id):
        if m.status != MS.active:
            await insert_operation(session, inst, OperationKind.recover, actor, member=m, params={"start": True})
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="apps.instance.start",
        resource_type="app_instance",
        resource_id=instance_id,
        tenant_id=inst.tenant_id,
        project_id=inst.project_id,
        after={"status": "starting"},
    )
    return await recompute_instance(session, instance_id, actor)


async def decommission(
    session: AsyncSession,
    principal: Principal,
    instance_id: uuid.UUID,
    reason: str,
    *,
    expected_version: int | None = None,
) -> Any:
    """Start (or retry) teardown: one `remove` operation per live member; `decommissioned` only once the
    controller has reported verified teardown for every one of them."""
    inst = await authorized_instance(session, principal, instance_id, "apps.instance.manage")
    check_version(inst.version, expected_version)
    if inst.status == IS.decommissioning:
        raise Conflict("decommission is already in progress", code="decommission_in_progress")
    domain.check_instance_transition(inst.status, IS.decommissioning)
    actor = principal.actor
    await _cancel_open(session, instance_id, actor, "instance decommissioning")
    round_no = int((inst.decommission or {}).get("round", 0)) + 1
    ops = []
    for m in await live_members(session, instance_id):
        op = await insert_operation(
            session,
            inst,
            OperationKind.remove,
            actor,
            member=m,
            params={"decommission": True, "round": round_no, "verify_teardown": True},
        )
        ops.append(str(op.operation_id))
    report = {
        "forced": False,
        "reason": reason,
        "round": round_no,
        "operation_ids": ops,
        "verified_member_ids": (inst.decommission or {}).get("verified_member_ids", []),
    }
    inst = await set_instance_status(
        session, inst, IS.decommissioning, actor, f"decommission requested: {reason}", decommission=report
    )
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="apps.instance.decommission",
        resource_type="app_instance",
        resource_id=instance_id,
        tenant_id=inst.tenant_id,
        project_id=inst.project_id,
        after={"status": "decommissioning", "round": round_no},
        reason=reason,
    )
    await check_decommission(session, instance_id, actor)
    return await load_instance(session, instance_id)


async def check_decommission(session: AsyncSession, instance_id: uuid.UUID, actor: Actor) -> None:
    inst = await load_instance(session, instance_id, lock=True)
    if inst.status != IS.decommissioning:
        return
    report = dict(inst.decommission or {})
    op_ids = [uuid.UUID(i) for i in report.get("operation_ids", [])]
    ops = (await session.execute(select(operations).where(operations.c.operation_id.in_(op_ids)))).all()
    if any(op.status in domain.OPEN_OPS for op in ops):
        return
    verified = list(report.get("verified_member_ids", []))
    unverified: list[str] = []
    evidence: list[str] = []
    for op in ops:
        ok = op.status == OS.succeeded and (op.result or {}).get("teardown_verified") is True
        (verified if ok else unverified).append(str(op.member_id))
        note = (op.result or {}).get("evidence") or op.error or op.status
        evidence.append(f"member {op.member_id}: {'verified' if ok else 'NOT verified'} ({note})")
    report |= {
        "verified_member_ids": verified,
        "unverified_member_ids": unverified,
        "evidence": [*report.get("evidence", []), *evidence],
    }
    if unverified:
        await set_instance_status(
            session,
            inst,
            IS.decommission_failed,
            actor,
            f"teardown not verified for {len(unverified)} member(s)",
            decommission=report,
        )
        return
    await set_instance_status(
        session, inst, IS.decommissioned, actor, "teardown verified for every member", decommission=report
    )
    await revoke_credentials(session, instance_id, actor)


async def force_decommission(
    session: AsyncSession,
    principal: Principal,
    instance_id: uuid.UUID,
    reason: str,
    *,
    expected_version: int | None = None,
) -> Any:
    inst = await authorized_instance(session, principal, instance_id, "apps.instance.manage")
    check_version(inst.version, expected_version)
    if inst.status not in (IS.decommission_failed, IS.decommissioning):
        raise Conflict("only a decommission that failed or is stuck can be forced", code="invalid_instance_transition")
    if not reason.strip():
        raise Unprocessable("a forced decommission needs a reason", code="reason_required")
    actor = principal.actor
    await _cancel_open(session, instance_id, actor, "decommission forced")
    report = dict(inst.decommission or {})
    verified = set(report.get("verified_member_ids", []))
    unverified = sorted(
        {
            *report.get("unverified_member_ids", []),
            *(str(m.member_id) for m in await live_members(session, instance_id)),
        }
        - verified
    )
    for m in await live_members(session, instance_id):
        await update_member(
            session,
            m.member_id,
            actor,
            status=MS.removed,
            tombstoned=True,
            tombstone_reason=f"decommission forced without verified teardown: {reason}",
        )
    if inst.status == IS.decommissioning:
        inst = await set_instance_status(
            session, inst, IS.decommission_failed, actor, "forcing decommission", decommission=report
        )
    report |= {
        "forced": True,
        "reason": reason,
        "unverified_member_ids": unverified,
        "evidence": [*report.get("evidence", []), f"FORCED by {actor.kind}:{actor.id}: {reason}"],
    }
    inst = await set_instance_status(
        session, inst, IS.decommissioned, actor, f"decommission FORCED: {reason}", decommission=report
    )
    await revoke_credentials(session, instance_id, actor)
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="apps.instance.decommission.force",
        resource_type="app_instance",
        resource_id=instance_id,
        tenant_id=inst.tenant_id,
        project_id=inst.project_id,
        before={"status": "decommission_failed"},
        after={"status": "decommissioned", "forced": True, "unverified_member_ids": unverified},
        reason=reason,
    )
    return inst


async def upgrade(
    session: AsyncSession,
    principal: Principal,
    instance_id: uuid.UUID,
    app_version: str | None,
    *,
    rollback: bool = False,
    expected_version: int | None = None,
) -> Any:
    """Ask the controller to roll out another version (`desired_*`); `rollback` targets the previous one."""
    inst = await authorized_instance(session, principal, instance_id, "apps.instance.manage")
    check_version(inst.version, expected_version)
    if inst.status not in domain.LIVE_INSTANCE and inst.status != IS.stopped:
        raise Conflict(f"an instance that is {inst.status} cannot change version", code="instance_not_live")
    if rollback:
        if inst.previous_manifest_id is None:
            raise Conflict("there is no previous version to roll back to", code="no_previous_version")
        target = (
            await session.execute(select(manifests).where(manifests.c.manifest_id == inst.previous_manifest_id))
        ).one()
    else:
        if not app_version:
            raise Unprocessable("app_version is required", code="validation_error")
        target = await find_manifest(session, inst.app_slug, app_version)
    if target.manifest_id == inst.manifest_id:
        raise Conflict(f"the instance already runs {target.app_version}", code="version_unchanged")
    await check_deployable(session, inst.tenant_id, target)
    manifest = target.state
    domain.validate_config(manifest.get("inputs") or {"type": "object"}, inst.config)
    actor = principal.actor
    inst = await update_instance(
        session, instance_id, actor, desired_manifest_id=target.manifest_id, desired_app_version=target.app_version
    )
    verb = "rollback" if rollback else "upgrade"
    await timeline(
        session,
        instance_id,
        f"instance.{verb}",
        f"{verb} to {target.app_version} requested",
        actor,
        from_version=inst.app_version,
        to_version=target.app_version,
    )
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action=f"apps.instance.{verb}",
        resource_type="app_instance",
        resource_id=instance_id,
        tenant_id=inst.tenant_id,
        project_id=inst.project_id,
        before={"app_version": inst.app_version},
        after={"desired_app_version": target.app_version},
    )
    return inst


# ------------------------------------------------------------------------------------------ credentials


async def rotate_credential(
    session: AsyncSession,
    principal: Principal,
    instance_id: uuid.UUID,
    credential_id: uuid.UUID,
    key_pair: KeyPair,
    sealed: Sealed,
) -> Any:
    inst = await authorized_instance(session, principal, instance_id, "apps.credential.rotate")
    if inst.status == IS.decommissioned:
        raise Conflict("the instance is decommissioned", code="instance_not_live")
    actor = principal.actor
    old = (
        await session.execute(
            select(credentials)
            .where(credentials.c.instance_id == instance_id, credentials.c.status == "active")
            .with_for_update()
        )
    ).first()
    alloc_ids = sorted({str(m.allocation_id) for m in await live_members(session, instance_id)})
    new = (
        await session.execute(
            insert(credentials)
            .values(
                credential_id=credential_id,
                instance_id=instance_id,
                tenant_id=inst.tenant_id,
                project_id=inst.project_id,
                public_key=key_pair.public_openssh,
                fingerprint=key_pair.fingerprint,
                status="active",
                allocation_ids=alloc_ids,
                version=1,
                rotated_from=old.credential_id if old else None,
                **sealed.columns(),
            )
            .returning(*credentials.c)
        )
    ).one()
    await add_event(session, ev.AccessGrantRequested.build(data=grant_state(new), source=SOURCE, actor=actor))
    if old is not None:
        revoked = (
            await session.execute(
                update(credentials)
                .where(credentials.c.credential_id == old.credential_id)
                .values(status="revoked", revoked_at=now(), version=credentials.c.version + 1)
                .returning(*credentials.c)
            )
        ).one()
        await add_event(
            session, ev.AccessGrantRevoked.build(data=grant_state(revoked, "revoked"), source=SOURCE, actor=actor)
        )
    await timeline(
        session,
        instance_id,
        "credential.rotated",
        f"access credential rotated to {new.fingerprint}",
        actor,
        credential_id=credential_id,
    )
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="apps.credential.rotate",
        resource_type="access_credential",
        resource_id=credential_id,
        tenant_id=inst.tenant_id,
        project_id=inst.project_id,
        before={"fingerprint": old.fingerprint if old else None},
        after={"fingerprint": new.fingerprint},
    )
    return new


async def credential_for_controller(session: AsyncSession, principal: Principal, instance_id: uuid.UUID) -> Any:
    inst = await controller_instance(session, principal, instance_id)
    row = (
        await session.execute(
            select(credentials).where(credentials.c.instance_id == instance_id, credentials.c.status == "active")
        )
    ).first()
    if row is None:
        raise NotFound("the instance has no active access credential", code="credential_not_found")
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="apps.credential.fetch",
        resource_type="access_credential",
        resource_id=row.credential_id,
        tenant_id=inst.tenant_id,
        project_id=inst.project_id,
        after={"fingerprint": row.fingerprint},
    )
    return row


# ------------------------------------------------------------------------------------------ cascade (release saga)


async def allocation_release_requested(
    session: AsyncSession, allocation_id: uuid.UUID, tenant_id: uuid.UUID, project_id: uuid.UUID
) -> None:
    """Stop/remove every member on an allocation that is being released, then clear the release."""
    stmt = pg_insert(release_requests).values(allocation_id=allocation_id, tenant_id=tenant_id, project_id=project_id)
    await session.execute(
        stmt.on_conflict_do_update(
            index_elements=["allocation_id"], set_={"requested_at": now(), "cleared_at": None, "forced": False}
        )
    )
    on_it = (
        await session.execute(
            select(members)
            .where(members.c.allocation_id == allocation_id, members.c.tombstoned.is_(False))
            .with_for_update()
        )
    ).all()
    for m in on_it:
        inst = await load_instance(session, m.instance_id, lock=True)
        open_remove = (
            await session.execute(
                select(operations.c.operation_id).where(
                    operations.c.member_id == m.member_id,
                    operations.c.kind == OperationKind.remove,
                    operations.c.status.in_([s.value for s in domain.OPEN_OPS]),
                )
            )
        ).first()
        if open_remove is not None:
            continue
        # Anything else in flight on this member is moot now.
        others = (
            await session.execute(
                select(operations)
                .where(
                    or_(operations.c.member_id == m.member_id, operations.c.result_member_id == m.member_id),
                    operations.c.status.in_([s.value for s in domain.OPEN_OPS]),
                )
                .with_for_update()
            )
        ).all()
        for op in others:
            await update_operation(
                session,
                op,
                OS.cancelled,
                SYSTEM,
                f"{op.kind} cancelled: allocation released",
                lease_token=None,
                lease_expires_at=None,
                error="allocation released",
            )
        if m.status == MS.pending:
            await update_member(
                session,
                m.member_id,
                SYSTEM,
                status=MS.removed,
                tombstoned=True,
                tombstone_reason=f"allocation {allocation_id} released before the member started",
            )
            continue
        await timeline(
            session,
            inst.instance_id,
            "allocation.releasing",
            f"allocation {allocation_id} is being released: removing {m.component_key} member first",
            SYSTEM,
            allocation_id=allocation_id,
            member_id=m.member_id,
        )
        await insert_operation(
            session,
            inst,
            OperationKind.remove,
            SYSTEM,
            member=m,
            params={"reason": "allocation_release", "cascade": True, "verify_teardown": True},
        )
    for instance_id in {m.instance_id for m in on_it}:
        inst = await load_instance(session, instance_id, lock=True)
        if inst.status in (IS.running, IS.created, IS.starting):
            await set_instance_status(
                session, inst, IS.degraded, SYSTEM, f"allocation {allocation_id} is being released"
            )
    await check_release(session, allocation_id, SYSTEM)


async def check_release(session: AsyncSession, allocation_id: uuid.UUID, actor: Actor, *, force: bool = False) -> None:
    req = (
        await session.execute(
            select(release_requests).where(release_requests.c.allocation_id == allocation_id).with_for_update()
        )
    ).first()
    if req is None or req.cleared_at is not None:
        return
    remaining = (
        await session.execute(
            select(members).where(members.c.allocation_id == allocation_id, members.c.tombstoned.is_(False))
        )
    ).all()
    forced = req.forced
    if remaining and not force:
        return
    for m in remaining:  # forced: the release goes on; what we could not stop is recorded
        await _cancel_member_ops(session, m.member_id, actor)
        await update_member(
            session,
            m.member_id,
            actor,
            status=MS.removed,
            tombstoned=True,
            tombstone_reason=f"allocation {allocation_id} released without verified teardown",
        )
        forced = True
    failed = (
        await session.execute(
            select(func.count()).where(
                operations.c.allocation_id == allocation_id,
                operations.c.kind == OperationKind.remove,
                operations.c.status.in_([OS.failed, OS.cancelled]),
                operations.c.created_at >= req.requested_at,
            )
        )
    ).scalar_one()
    forced = forced or failed > 0
    stopped = (
        await session.execute(
            select(members.c.member_id, members.c.instance_id).where(
                members.c.allocation_id == allocation_id, members.c.status_changed_at >= req.requested_at
            )
        )
    ).all()
    at = now()
    await session.execute(
        update(release_requests)
        .where(release_requests.c.allocation_id == allocation_id)
        .values(cleared_at=at, forced=forced)
    )
    await add_event(
        session,
        ev.ReleaseClearanceGranted.build(
            source=SOURCE,
            actor=actor,
            data=ev.ReleaseClearance(
                allocation_id=allocation_id,
                tenant_id=req.tenant_id,
                project_id=req.project_id,
                stopped_member_ids=[s.member_id for s in stopped],
                instance_ids=sorted({s.instance_id for s in stopped}),
                forced=forced,
                cleared_at=at,
            ),
        ),
    )
    for instance_id in {s.instance_id for s in stopped}:
        await timeline(
            session,
            instance_id,
            "allocation.cleared",
            f"allocation {allocation_id} cleared for release" + (" (forced)" if forced else ""),
            actor,
            allocation_id=allocation_id,
            forced=forced,
        )
        inst = await load_instance(session, instance_id, lock=True)
        if inst.status in domain.LIVE_INSTANCE:
            await recompute_instance(session, instance_id, actor)
        await sync_grant(session, instance_id, actor)


async def _cancel_member_ops(session: AsyncSession, member_id: uuid.UUID, actor: Actor) -> None:
    rows = (
        await session.execute(
            select(operations)
            .where(
                or_(operations.c.member_id == member_id, operations.c.result_member_id == member_id),
                operations.c.status.in_([s.value for s in domain.OPEN_OPS]),
            )
            .with_for_update()
        )
    ).all()
    for op in rows:
        await update_operation(
            session,
            op,
            OS.cancelled,
            actor,
            f"{op.kind} cancelled: release clearance timed out",
            lease_token=None,
            lease_expires_at=None,
            error="release clearance timed out",
        )


# ------------------------------------------------------------------------------------------ reconciler


async def expire_leases(session: AsyncSession, limit: int = 100) -> int:
    """Requeue operations whose lease ran out (the controller crashed or hung)."""
    rows = (
        await session.execute(
            select(operations)
            .where(operations.c.status.in_([OS.claimed, OS.in_progress]), operations.c.lease_expires_at < now())
            .order_by(operations.c.lease_expires_at)
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
    ).all()
    for op in rows:
        await update_operation(
            session,
            op,
            OS.pending,
            SYSTEM,
            f"lease of {op.claimed_by} expired; {op.kind} {op.operation_id} requeued",
            lease_token=None,
            lease_expires_at=None,
            claimed_by=None,
        )
    return len(rows)


async def overdue_releases(session: AsyncSession, timeout_s: int) -> int:
    rows = (
        await session.execute(
            select(release_requests.c.allocation_id)
            .where(
                release_requests.c.cleared_at.is_(None),
                release_requests.c.requested_at < now() - timedelta(seconds=timeout_s),
            )
            .with_for_update(skip_locked=True)
        )
    ).all()
    for r in rows:
        await check_release(session, r.allocation_id, SYSTEM, force=True)
    return len(rows)
