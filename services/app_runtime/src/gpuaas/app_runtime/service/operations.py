"""Member operations: requesting them (users or the instance's controller), the controller's leases
(claim, heartbeat, complete, fail), what an outcome drives, and requeueing the operations whose lease ran
out (the reconciler).

A claim holds the operation with a lease token until `lease_expires_at`; heartbeats extend it. A lease
that runs out puts the operation back to pending, so another claimer (or the same controller, restarted)
takes it over.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.app_runtime import domain
from gpuaas.app_runtime.metrics import leases_expired
from gpuaas.app_runtime.models import operations
from gpuaas.app_runtime.service.common import (
    OPEN_STATUSES,
    SYSTEM,
    actor_of,
    audit_on,
    authorized_instance,
    check_controller,
    controller_instance,
    controller_project,
    insert_operation,
    live_members,
    load_instance,
    load_member,
    load_operation,
    now,
    on_member,
    recompute_instance,
    tombstone_member,
    update_instance,
    update_member,
    update_operation,
)
from gpuaas.app_runtime.service.credentials import sync_grant
from gpuaas.app_runtime.service.deploy import allocation_views, compatibility_of
from gpuaas.app_runtime.service.instance_records import load_manifest
from gpuaas.app_runtime.service.lifecycle import check_decommission, check_stopped
from gpuaas.app_runtime.service.ordering import claimable, next_claimable, ordering_hold, reoffer_deferred
from gpuaas.app_runtime.service.release import check_release
from gpuaas.app_runtime.service.views import ClaimView, OperationView, from_row
from gpuaas.contracts import Actor
from gpuaas.contracts.enums import InstanceStatus
from gpuaas.contracts.events.app_runtime import MemberStatus, OperationKind, OperationStatus
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, NotFound, Unprocessable
from gpuaas.kit.versioning import check_version

# What a claim does to the member an operation works on.
MEMBER_STATUS_WHEN_CLAIMED = {
    OperationKind.add: MemberStatus.starting,
    OperationKind.replace: MemberStatus.starting,
    OperationKind.recover: MemberStatus.starting,
    OperationKind.drain: MemberStatus.draining,
    OperationKind.remove: MemberStatus.stopping,
}


# ------------------------------------------------------------------------------------------ requests


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
) -> OperationView:
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
        member = await load_member(session, member_id, instance_id=instance_id, lock=True)
        if member.tombstoned:
            raise Conflict("the member is a tombstone", code="member_tombstoned")
        busy = (
            await session.execute(
                select(operations.c.operation_id).where(on_member(member_id), operations.c.status.in_(OPEN_STATUSES))
            )
        ).first()
        if busy is not None:
            raise Conflict(f"operation {busy[0]} is still open on this member", code="operation_in_flight")
    manifest = await load_manifest(session, inst.manifest_id)
    compatibility = compatibility_of(manifest)
    if kind in (OperationKind.add, OperationKind.replace):
        if allocation_id is None:
            raise Unprocessable(f"a {kind} operation needs allocation_id", code="allocation_required")
        views = await allocation_views(session, [allocation_id])
        domain.check_allocation(allocation_id, inst.project_id, views.get(allocation_id), compatibility)
        live = await live_members(session, instance_id)
        others = {m.allocation_id for m in live}
        if allocation_id not in others and others and not compatibility.get("multi_allocation", False):
            raise Unprocessable("this app does not span several allocations", code="incompatible_multi_allocation")
        if kind is OperationKind.add:
            roles = manifest.state.get("roles") or []
            component_key = component_key or domain.component_keys(roles)[1]
            domain.check_add_component(roles, component_key, (m.component_key for m in live))
    else:
        allocation_id = None
    if kind is OperationKind.remove and member is not None and member.status == MemberStatus.stopped:
        params = {**params, "drained": True}  # drained before: the controller's remove need not drain again
    await reoffer_deferred(session, instance_id)
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
    await audit_on(
        session,
        principal,
        f"apps.operation.{kind}",
        op,
        after={
            "instance_id": str(instance_id),
            "member_id": str(op.member_id) if op.member_id else None,
            "allocation_id": str(op.allocation_id) if op.allocation_id else None,
        },
    )
    return op


async def controller_operations(
    session: AsyncSession, principal: Principal, app_slug: str, statuses: Sequence[str]
) -> list[OperationView]:
    """The operations of the controller's app in its project (those in `statuses`, if any)."""
    project_id = controller_project(principal)
    await check_controller(session, principal, project_id, app_slug)
    stmt = select(operations).where(operations.c.project_id == project_id, operations.c.app_slug == app_slug)
    if statuses:
        stmt = stmt.where(operations.c.status.in_(list(statuses)))
    return [from_row(OperationView, r) for r in await session.execute(stmt.order_by(operations.c.operation_id))]


# ------------------------------------------------------------------------------------------ leases


async def claim(
    session: AsyncSession,
    principal: Principal,
    *,
    app_slug: str,
    operation_id: uuid.UUID | None,
    lease_s: int,
    holder: str | None,
) -> ClaimView | None:
    """Claim one operation (a given one, or the oldest claimable of the app) with a lease.

    A pending operation, or one whose lease has expired, can be claimed; concurrent claimers are
    serialised by the row lock (`SKIP LOCKED` for claim-next), so exactly one gets it. Claim-next skips
    operations their controller deferred (until then, or until the instance changes) and those the app's
    role ordering holds back (`service/ordering.py`); a given operation held back is refused, saying why.
    """
    project_id = controller_project(principal)
    await check_controller(session, principal, project_id, app_slug)
    at = now()
    if operation_id is not None:
        row = (
            await session.execute(
                select(operations)
                .where(
                    operations.c.project_id == project_id,
                    operations.c.app_slug == app_slug,
                    operations.c.operation_id == operation_id,
                    claimable(at),
                )
                .with_for_update()
            )
        ).first()
        if row is None:
            await _explain_unclaimable(session, project_id, app_slug, operation_id)
            return None
        op = from_row(OperationView, row)
        if (hold := await ordering_hold(session, op)) is not None:
            raise Conflict(f"held back by the app's role ordering: {hold}", code="operation_held", reason=hold)
    else:
        found = await next_claimable(session, project_id, app_slug, at)
        if found is None:
            return None
        op = found
    token = uuid.uuid4()
    actor = principal.actor
    if op.status != OperationStatus.pending:  # the previous holder lost it: record the requeue, then the new claim
        leases_expired(session, 1)
        op = await update_operation(
            session,
            op,
            OperationStatus.pending,
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
        OperationStatus.claimed,
        actor,
        f"{op.kind} operation claimed by {claimed_by} (attempt {op.attempt + 1})",
        claimed_by=claimed_by,
        lease_token=token,
        lease_expires_at=at + timedelta(seconds=lease_s),
        lease_s=lease_s,
        deferred_until=None,
        attempt=op.attempt + 1,
    )
    target = op.result_member_id if op.kind in ("add", "replace") or op.result_member_id else op.member_id
    if target is not None:
        member_status = MEMBER_STATUS_WHEN_CLAIMED[OperationKind(op.kind)]
        await update_member(session, target, actor, status=member_status, last_operation_id=op.operation_id)
        await recompute_instance(session, op.instance_id, actor)
    return ClaimView(operation=op, lease_token=token, lease_expires_at=op.lease_expires_at)


async def _explain_unclaimable(
    session: AsyncSession, project_id: uuid.UUID, app_slug: str, operation_id: uuid.UUID
) -> None:
    """Why a given operation cannot be claimed: unknown to this controller, or not claimable now."""
    status = (
        await session.execute(
            select(operations.c.status).where(
                operations.c.operation_id == operation_id,
                operations.c.project_id == project_id,
                operations.c.app_slug == app_slug,
            )
        )
    ).scalar()
    if status is None:
        raise NotFound("operation not found", code="operation_not_found")
    raise Conflict(f"the operation is {status} and its lease (if any) is live", code="operation_not_claimable")


async def _held_operation(
    session: AsyncSession, principal: Principal, operation_id: uuid.UUID, lease_token: uuid.UUID
) -> OperationView:
    """The operation, locked, if the caller is its controller and still holds its lease."""
    op = await load_operation(session, operation_id)
    await check_controller(session, principal, op.project_id, op.app_slug)
    if op.lease_token != lease_token or op.status not in (OperationStatus.claimed, OperationStatus.in_progress):
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
    lease_s: int | None,
    default_lease_s: int,
    message: str | None,
    percent: int | None,
) -> OperationView:
    """Extend the lease, with progress (the operation is then in progress). Without `lease_s` the lease
    keeps the length its claim asked for (`default_lease_s` for a claim from before that was recorded)."""
    op = await _held_operation(session, principal, operation_id, lease_token)
    length = lease_s or op.lease_s or default_lease_s
    values: dict[str, Any] = {"lease_expires_at": now() + timedelta(seconds=length), "lease_s": length}
    if message is not None:
        values["progress_message"] = message
    if percent is not None:
        values["progress_percent"] = percent
    return await update_operation(
        session,
        op,
        OperationStatus.in_progress,
        principal.actor,
        (message and f"{op.kind} {operation_id}: {message}") or "",
        **values,
    )


async def defer(
    session: AsyncSession,
    principal: Principal,
    operation_id: uuid.UUID,
    lease_token: uuid.UUID,
    *,
    reason: str,
    delay_s: int,
) -> OperationView:
    """The controller cannot act yet (say a worker's add before its head is up): the operation goes back to
    pending without counting as an attempt, and is offered again after `delay_s`, or as soon as the instance
    changes (an operation of it finished, a member or the instance was reported, an operation requested)."""
    op = await _held_operation(session, principal, operation_id, lease_token)
    return await update_operation(
        session,
        op,
        OperationStatus.pending,
        principal.actor,
        f"{op.kind} {operation_id} deferred by its controller" + (f": {reason}" if reason else ""),
        lease_token=None,
        lease_expires_at=None,
        claimed_by=None,
        attempt=max(op.attempt - 1, 0),
        deferred_until=now() + timedelta(seconds=delay_s),
    )


async def complete(
    session: AsyncSession,
    principal: Principal,
    operation_id: uuid.UUID,
    lease_token: uuid.UUID,
    result: dict[str, Any],
    member_detail: dict[str, Any] | None,
) -> OperationView:
    """The controller finished the operation: its members move on (a `remove` is verified only with
    `result.teardown_verified`)."""
    op = await _held_operation(session, principal, operation_id, lease_token)
    actor = principal.actor
    op = await update_operation(
        session,
        op,
        OperationStatus.succeeded,
        actor,
        lease_token=None,
        lease_expires_at=None,
        result=result,
        progress_percent=100,
    )
    await _members_after_success(session, op, actor, result, member_detail)
    await after_operation(session, op, actor)
    await audit_on(session, principal, "apps.operation.complete", op, after={"status": op.status, "result": result})
    return op


async def _members_after_success(
    session: AsyncSession,
    op: OperationView,
    actor: Actor,
    result: dict[str, Any],
    member_detail: dict[str, Any] | None,
) -> None:
    detail = {"detail": member_detail} if member_detail is not None else {}
    if op.kind in ("add", "replace") or (op.kind == "recover" and op.result_member_id):
        assert op.result_member_id is not None  # these kinds bring up a member of their own
        await update_member(session, op.result_member_id, actor, status=MemberStatus.active, **detail)
        if op.kind != "add":
            assert op.member_id is not None
            await tombstone_member(
                session,
                op.member_id,
                actor,
                f"replaced by member {op.result_member_id} ({op.kind} {op.operation_id})",
                # a recovered member failed: its tombstone keeps saying so
                status=MemberStatus.failed if op.kind == "recover" else MemberStatus.removed,
            )
    elif op.member_id is None:
        return
    elif op.kind == "recover":
        await update_member(session, op.member_id, actor, status=MemberStatus.active, **detail)
    elif op.kind == "drain":
        await update_member(session, op.member_id, actor, status=MemberStatus.stopped, **detail)
    elif op.kind == "remove":
        verified = result.get("teardown_verified") is True
        await update_member(
            session,
            op.member_id,
            actor,
            status=MemberStatus.removed,
            tombstoned=True,
            tombstone_reason=f"removed by {op.operation_id}" + ("" if verified else " (teardown not verified)"),
            **detail,
        )


async def fail(
    session: AsyncSession,
    principal: Principal | Actor,
    op: OperationView,
    error: str,
    *,
    forced: bool = False,
    message: str = "",
) -> OperationView:
    """The operation failed (its controller says so, or an operator forces it): so does its member."""
    actor = actor_of(principal)
    op = await update_operation(
        session,
        op,
        OperationStatus.failed,
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


async def _member_after_failure(session: AsyncSession, op: OperationView, actor: Actor, error: str) -> None:
    if op.kind in ("replace", "recover") and op.result_member_id:
        await tombstone_member(
            session,
            op.result_member_id,
            actor,
            f"{op.kind} {op.operation_id} failed: {error}",
            status=MemberStatus.failed,
        )
        return
    if op.member_id is None:
        return
    member = await load_member(session, op.member_id)
    if not member.tombstoned:
        await update_member(
            session, op.member_id, actor, status=MemberStatus.failed, detail={**(member.detail or {}), "error": error}
        )


async def controller_fail(
    session: AsyncSession, principal: Principal, operation_id: uuid.UUID, lease_token: uuid.UUID, error: str
) -> OperationView:
    op = await _held_operation(session, principal, operation_id, lease_token)
    op = await fail(session, principal, op, error)
    await audit_on(session, principal, "apps.operation.fail", op, after={"error": error})
    return op


async def after_operation(session: AsyncSession, op: OperationView, actor: Actor) -> None:
    """Everything an operation's outcome drives: instance status, decommission and stop progress,
    release clearances, the access grant's allocations."""
    inst = await load_instance(session, op.instance_id, lock=True)
    await reoffer_deferred(session, op.instance_id)
    if inst.status in domain.LIVE_INSTANCE:
        await recompute_instance(session, op.instance_id, actor)
    elif inst.status == InstanceStatus.decommissioning:
        await check_decommission(session, op.instance_id, actor)
    elif inst.status == InstanceStatus.stopping:
        await check_stopped(session, op.instance_id, actor)
    if op.allocation_id is not None:
        await check_release(session, op.allocation_id, actor)
    await sync_grant(session, op.instance_id, actor)


# ------------------------------------------------------------------------------------------ reconciler


async def expire_leases(session: AsyncSession, limit: int = 100) -> int:
    """Requeue operations whose lease ran out (the controller crashed or hung)."""
    rows = await session.execute(
        select(operations)
        .where(
            operations.c.status.in_([OperationStatus.claimed, OperationStatus.in_progress]),
            operations.c.lease_expires_at < now(),
        )
        .order_by(operations.c.lease_expires_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    expired = [from_row(OperationView, r) for r in rows]
    for op in expired:
        await update_operation(
            session,
            op,
            OperationStatus.pending,
            SYSTEM,
            f"lease of {op.claimed_by} expired; {op.kind} {op.operation_id} requeued",
            lease_token=None,
            lease_expires_at=None,
            claimed_by=None,
        )
    leases_expired(session, len(expired))
    return len(expired)
