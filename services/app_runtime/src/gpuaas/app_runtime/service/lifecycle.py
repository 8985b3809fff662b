"""An instance's lifecycle: what its controller reports (instance and member status, health, the version
rolled out), stop and start, and decommission (verified teardown of every member, or forced with a reason).
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.app_runtime import domain
from gpuaas.app_runtime.models import operations
from gpuaas.app_runtime.service.common import (
    OPEN_STATUSES,
    audit_on,
    authorized_instance,
    cancel_open_operation,
    controller_instance,
    insert_operation,
    live_members,
    load_instance,
    load_member,
    now,
    open_operations,
    recompute_instance,
    set_instance_status,
    timeline,
    tombstone_member,
    update_instance,
    update_member,
)
from gpuaas.app_runtime.service.credentials import revoke_credentials
from gpuaas.app_runtime.service.instance_records import allocation_gone, load_manifest
from gpuaas.app_runtime.service.ordering import reoffer_deferred
from gpuaas.app_runtime.service.views import InstanceView, MemberView, OperationView, from_row
from gpuaas.contracts import Actor
from gpuaas.contracts.enums import InstanceStatus
from gpuaas.contracts.events.app_runtime import InstanceHealth, MemberStatus, OperationKind, OperationStatus
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, Unprocessable
from gpuaas.kit.versioning import check_version

# ------------------------------------------------------------------------------------------ controller reports


async def report_instance(
    session: AsyncSession,
    principal: Principal,
    instance_id: uuid.UUID,
    *,
    status: str | None,
    health: dict[str, Any] | None,
    runtime_detail: dict[str, Any] | None,
    app_version: str | None,
) -> InstanceView:
    """The controller reports the instance's status, health, runtime detail or the version it rolled out."""
    inst = await controller_instance(session, principal, instance_id, lock=True)
    if inst.status == InstanceStatus.decommissioned:
        raise Conflict("the instance is decommissioned", code="instance_not_live")
    actor = principal.actor
    values: dict[str, Any] = {}
    if health is not None:
        values["health"] = InstanceHealth.model_validate({**health, "checked_at": now()}).model_dump(mode="json")
    if runtime_detail is not None:
        values["runtime_detail"] = runtime_detail
    if app_version is not None:
        if app_version != inst.desired_app_version:
            raise Conflict(f"no rollout to {app_version} was requested", code="version_not_desired")
        target = await load_manifest(session, inst.desired_manifest_id)
        values |= {
            "previous_manifest_id": inst.manifest_id,
            "manifest_id": target.manifest_id,
            "app_version": target.app_version,
            "artifact_digest": target.digest,
            "desired_manifest_id": None,
            "desired_app_version": None,
        }
        await timeline(
            session, instance_id, "instance.version", f"now running {app_version} (was {inst.app_version})", actor
        )
    if values:
        inst = await update_instance(session, instance_id, actor, **values)
    if status is not None and status != inst.status:
        if status not in (InstanceStatus.running, InstanceStatus.degraded, InstanceStatus.failed):
            raise Unprocessable("a controller reports running, degraded or failed", code="invalid_status")
        if inst.status not in domain.LIVE_INSTANCE:
            raise Conflict(f"the instance is {inst.status}", code="invalid_instance_transition")
        reason = (health or {}).get("message") or ""
        inst = await set_instance_status(
            session,
            inst,
            InstanceStatus(status),
            actor,
            f"controller reported {status} {reason}",
            failure_reason=reason if status == InstanceStatus.failed else None,
        )
    await audit_on(
        session,
        principal,
        "apps.instance.report",
        inst,
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
) -> MemberView:
    """The controller reports a member active or failed, or its detail."""
    member = await load_member(session, member_id, lock=True)
    await controller_instance(session, principal, member.instance_id)
    if member.tombstoned:
        raise Conflict("the member is a tombstone", code="member_tombstoned")
    values: dict[str, Any] = {}
    if detail is not None:
        values["detail"] = detail
    if status is not None and status != member.status:
        if status not in (MemberStatus.active, MemberStatus.failed):
            raise Unprocessable(
                "a controller reports a member active or failed (operations do the rest)", code="invalid_status"
            )
        values["status"] = status
    if values:
        member = await update_member(session, member_id, principal.actor, **values)
        await reoffer_deferred(session, member.instance_id)  # a deferred operation may wait on this member
        inst = await load_instance(session, member.instance_id, lock=True)
        if inst.status in domain.LIVE_INSTANCE:
            await recompute_instance(session, member.instance_id, principal.actor)
    await audit_on(session, principal, "apps.member.report", member, after={"status": member.status})
    return member


# ------------------------------------------------------------------------------------------ stop and start


async def _cancel_open(session: AsyncSession, instance_id: uuid.UUID, actor: Actor, why: str) -> None:
    """Cancel every open operation of the instance (it is stopping or being torn down); a member an
    `add` was to bring up and that never started goes with it."""
    for op in await open_operations(session, operations.c.instance_id == instance_id):
        await cancel_open_operation(session, op, actor, why, f"{op.kind} {op.operation_id} cancelled: {why}")
        if op.kind == OperationKind.add and op.member_id:
            member = await load_member(session, op.member_id)
            if member.status == MemberStatus.pending:
                await tombstone_member(session, op.member_id, actor, f"add cancelled: {why}")


async def stop(
    session: AsyncSession, principal: Principal, instance_id: uuid.UUID, *, expected_version: int | None = None
) -> InstanceView:
    """Drain every member; the instance is `stopped` once no operation is open."""
    inst = await authorized_instance(session, principal, instance_id, "apps.instance.manage")
    check_version(inst.version, expected_version)
    stoppable = (InstanceStatus.created, InstanceStatus.starting, InstanceStatus.running, InstanceStatus.degraded)
    if inst.status not in stoppable:
        raise Conflict(f"an instance that is {inst.status} cannot be stopped", code="invalid_instance_transition")
    actor = principal.actor
    await _cancel_open(session, instance_id, actor, "instance stopping")
    inst = await set_instance_status(session, inst, InstanceStatus.stopping, actor, "stop requested")
    for m in await live_members(session, instance_id):
        if m.status not in (MemberStatus.stopped, MemberStatus.removed):
            await insert_operation(session, inst, OperationKind.drain, actor, member=m, params={"stop": True})
    await check_stopped(session, instance_id, actor)
    await audit_on(session, principal, "apps.instance.stop", inst, after={"status": "stopping"})
    return await load_instance(session, instance_id)


async def check_stopped(session: AsyncSession, instance_id: uuid.UUID, actor: Actor) -> None:
    """A stopping instance with no open operation left is stopped."""
    inst = await load_instance(session, instance_id, lock=True)
    if inst.status != InstanceStatus.stopping:
        return
    open_ops = (
        await session.execute(
            select(func.count()).where(operations.c.instance_id == instance_id, operations.c.status.in_(OPEN_STATUSES))
        )
    ).scalar_one()
    if open_ops == 0:
        await set_instance_status(session, inst, InstanceStatus.stopped, actor, "every member drained")


async def start(
    session: AsyncSession, principal: Principal, instance_id: uuid.UUID, *, expected_version: int | None = None
) -> InstanceView:
    """Recover every member that is not active."""
    inst = await authorized_instance(session, principal, instance_id, "apps.instance.manage")
    check_version(inst.version, expected_version)
    if inst.status not in (InstanceStatus.stopped, InstanceStatus.failed):
        raise Conflict(f"an instance that is {inst.status} cannot be started", code="invalid_instance_transition")
    actor = principal.actor
    inst = await set_instance_status(session, inst, InstanceStatus.starting, actor, "start requested")
    for m in await live_members(session, instance_id):
        if m.status != MemberStatus.active:
            await insert_operation(session, inst, OperationKind.recover, actor, member=m, params={"start": True})
    await audit_on(session, principal, "apps.instance.start", inst, after={"status": "starting"})
    return await recompute_instance(session, instance_id, actor)


# ------------------------------------------------------------------------------------------ decommission


async def decommission(
    session: AsyncSession,
    principal: Principal,
    instance_id: uuid.UUID,
    reason: str,
    *,
    expected_version: int | None = None,
) -> InstanceView:
    """Start (or retry) teardown: one `remove` operation per live member; `decommissioned` only once the
    controller has reported verified teardown for every one of them."""
    inst = await authorized_instance(session, principal, instance_id, "apps.instance.manage")
    check_version(inst.version, expected_version)
    if inst.status == InstanceStatus.decommissioning:
        raise Conflict("decommission is already in progress", code="decommission_in_progress")
    domain.check_instance_transition(inst.status, InstanceStatus.decommissioning)
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
        session, inst, InstanceStatus.decommissioning, actor, f"decommission requested: {reason}", decommission=report
    )
    await audit_on(
        session,
        principal,
        "apps.instance.decommission",
        inst,
        after={"status": "decommissioning", "round": round_no},
        reason=reason,
    )
    await check_decommission(session, instance_id, actor)
    return await load_instance(session, instance_id)


def decommissioned_health() -> dict[str, Any]:
    """A decommissioned instance serves nothing: the controller's last report (say `healthy, 3 member(s)
    serving`) would be a lie, and no controller reports on it any more."""
    return InstanceHealth(status="unknown", message="instance decommissioned", checked_at=now()).model_dump(mode="json")


def decommissioned_detail(inst: InstanceView) -> dict[str, Any]:
    """Likewise its runtime detail (say the URL it served): dropped, but for what the platform itself keeps
    there (`launch`, the allocation of a launchable app)."""
    return {k: v for k, v in (inst.runtime_detail or {}).items() if k == "launch"}


async def check_decommission(session: AsyncSession, instance_id: uuid.UUID, actor: Actor) -> None:
    """Once every `remove` of the round is finished: decommissioned if each teardown was verified, else
    decommission_failed with the evidence."""
    inst = await load_instance(session, instance_id, lock=True)
    if inst.status != InstanceStatus.decommissioning:
        return
    if (launched := (inst.runtime_detail or {}).get("launch")) and not await allocation_gone(
        session, uuid.UUID(launched["allocation_id"])
    ):
        return  # a launchable app: decommissioned once allocations released its allocation (service/launch.py)
    report = dict(inst.decommission or {})
    op_ids = [uuid.UUID(i) for i in report.get("operation_ids", [])]
    rows = await session.execute(select(operations).where(operations.c.operation_id.in_(op_ids)))
    ops = [from_row(OperationView, r) for r in rows]
    if any(op.status in domain.OPEN_OPS for op in ops):
        return
    verified = list(report.get("verified_member_ids", []))
    unverified: list[str] = []
    evidence: list[str] = []
    for op in ops:
        ok = op.status == OperationStatus.succeeded and (op.result or {}).get("teardown_verified") is True
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
            InstanceStatus.decommission_failed,
            actor,
            f"teardown not verified for {len(unverified)} member(s)",
            decommission=report,
        )
        return
    await set_instance_status(
        session,
        inst,
        InstanceStatus.decommissioned,
        actor,
        "teardown verified for every member",
        decommission=report,
        health=decommissioned_health(),
        runtime_detail=decommissioned_detail(inst),
    )
    await revoke_credentials(session, instance_id, actor)


async def force_decommission(
    session: AsyncSession,
    principal: Principal,
    instance_id: uuid.UUID,
    reason: str,
    *,
    expected_version: int | None = None,
) -> InstanceView:
    """Complete a failed or stuck decommission without verification: recorded as forced, with the reason
    and the members whose teardown nobody verified."""
    inst = await authorized_instance(session, principal, instance_id, "apps.instance.manage")
    check_version(inst.version, expected_version)
    if inst.status not in (InstanceStatus.decommission_failed, InstanceStatus.decommissioning):
        raise Conflict("only a decommission that failed or is stuck can be forced", code="invalid_instance_transition")
    if not reason.strip():
        raise Unprocessable("a forced decommission needs a reason", code="reason_required")
    actor = principal.actor
    await _cancel_open(session, instance_id, actor, "decommission forced")
    report = dict(inst.decommission or {})
    verified = set(report.get("verified_member_ids", []))
    remaining = await live_members(session, instance_id)
    unverified = sorted({*report.get("unverified_member_ids", []), *(str(m.member_id) for m in remaining)} - verified)
    for m in remaining:
        await tombstone_member(session, m.member_id, actor, f"decommission forced without verified teardown: {reason}")
    if inst.status == InstanceStatus.decommissioning:
        inst = await set_instance_status(
            session, inst, InstanceStatus.decommission_failed, actor, "forcing decommission", decommission=report
        )
    report |= {
        "forced": True,
        "reason": reason,
        "unverified_member_ids": unverified,
        "evidence": [*report.get("evidence", []), f"FORCED by {actor.kind}:{actor.id}: {reason}"],
    }
    inst = await set_instance_status(
        session,
        inst,
        InstanceStatus.decommissioned,
        actor,
        f"decommission FORCED: {reason}",
        decommission=report,
        health=decommissioned_health(),
        runtime_detail=decommissioned_detail(inst),
    )
    await revoke_credentials(session, instance_id, actor)
    await audit_on(
        session,
        principal,
        "apps.instance.decommission.force",
        inst,
        before={"status": "decommission_failed"},
        after={"status": "decommissioned", "forced": True, "unverified_member_ids": unverified},
        reason=reason,
    )
    return inst
