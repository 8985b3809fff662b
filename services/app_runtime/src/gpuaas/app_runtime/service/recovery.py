"""Operators' recovery of a member operation (`apps.operation.manage`): retry it, cancel it, or force it to
fail. Each is the same sequence (load the operation, locked, with the caller's permission and the version
they read; check the status allows it; act; audit before → after with the reason): `_recover` runs it.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.app_runtime import domain
from gpuaas.app_runtime.service.common import (
    audit_on,
    cancel_open_operation,
    load_instance,
    load_member,
    load_operation,
    tombstone_member,
    update_member,
    update_operation,
)
from gpuaas.app_runtime.service.operations import after_operation, fail
from gpuaas.app_runtime.service.views import OperationView
from gpuaas.contracts.enums import InstanceStatus
from gpuaas.contracts.events.app_runtime import MemberStatus, OperationStatus
from gpuaas.kit import iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, NotFound, Unprocessable
from gpuaas.kit.versioning import check_version


@dataclass(frozen=True)
class _Recovery:
    action: str  # the audit action's last part
    done: str  # how the refusal names it: "a failed operation cannot be <done>"
    allowed: frozenset[OperationStatus]  # the statuses it applies to


RETRY = _Recovery(
    "retry",
    "retried",
    frozenset(
        {OperationStatus.failed, OperationStatus.cancelled, OperationStatus.claimed, OperationStatus.in_progress}
    ),
)
CANCEL = _Recovery("cancel", "cancelled", domain.OPEN_OPS)
FORCE_FAIL = _Recovery("force_fail", "force-failed", domain.OPEN_OPS)


async def _recover(
    session: AsyncSession,
    principal: Principal,
    operation_id: uuid.UUID,
    reason: str,
    expected_version: int | None,
    recovery: _Recovery,
    act: Callable[[OperationView], Awaitable[OperationView]],
) -> OperationView:
    op = await load_operation(session, operation_id)
    try:
        await iam.authorize(session, principal, "apps.instance.read", project_id=op.project_id)
    except NotFound:
        raise NotFound("operation not found", code="operation_not_found") from None
    await iam.authorize(session, principal, "apps.operation.manage", project_id=op.project_id)
    check_version(op.version, expected_version)
    if op.status not in recovery.allowed:
        raise Conflict(f"a {op.status} operation cannot be {recovery.done}", code="invalid_operation_transition")
    before = op.status
    op = await act(op)
    await audit_on(
        session,
        principal,
        f"apps.operation.{recovery.action}",
        op,
        before={"status": before},
        after={"status": op.status, **({"forced": True} if recovery is FORCE_FAIL else {})},
        reason=reason,
    )
    return op


async def retry_operation(
    session: AsyncSession,
    principal: Principal,
    operation_id: uuid.UUID,
    reason: str,
    *,
    expected_version: int | None = None,
) -> OperationView:
    """Back to pending (a lease it had is dropped); an `add` whose member failed brings it up again."""

    async def act(op: OperationView) -> OperationView:
        inst = await load_instance(session, op.instance_id, lock=True)
        if inst.status == InstanceStatus.decommissioned:
            raise Conflict("the instance is decommissioned", code="instance_not_live")
        if (
            op.result_member_id
            and op.kind in ("replace", "recover")
            and op.status in (OperationStatus.failed, OperationStatus.cancelled)
        ):
            raise Conflict(
                f"request a new {op.kind} operation: this one's member is a tombstone", code="operation_not_retryable"
            )
        op = await update_operation(
            session,
            op,
            OperationStatus.pending,
            principal.actor,
            f"operator retried {op.kind} {operation_id} ({reason})",
            lease_token=None,
            lease_expires_at=None,
            claimed_by=None,
            error=None,
            forced=False,
        )
        if op.member_id is not None:
            member = await load_member(session, op.member_id)
            if not member.tombstoned and member.status == MemberStatus.failed and op.kind == "add":
                await update_member(session, op.member_id, principal.actor, status=MemberStatus.pending)
        return op

    return await _recover(session, principal, operation_id, reason, expected_version, RETRY, act)


async def cancel_operation(
    session: AsyncSession,
    principal: Principal,
    operation_id: uuid.UUID,
    reason: str,
    *,
    expected_version: int | None = None,
) -> OperationView:
    """Cancel an open operation; the member it was to bring up becomes a tombstone."""

    async def act(op: OperationView) -> OperationView:
        op = await cancel_open_operation(
            session, op, principal.actor, reason, f"operator cancelled {op.kind} {operation_id} ({reason})"
        )
        if op.kind == "add" and op.member_id:
            await tombstone_member(session, op.member_id, principal.actor, f"add {op.operation_id} cancelled: {reason}")
        elif op.result_member_id:
            await tombstone_member(
                session, op.result_member_id, principal.actor, f"{op.kind} {op.operation_id} cancelled: {reason}"
            )
        await after_operation(session, op, principal.actor)
        return op

    return await _recover(session, principal, operation_id, reason, expected_version, CANCEL, act)


async def force_fail_operation(
    session: AsyncSession,
    principal: Principal,
    operation_id: uuid.UUID,
    reason: str,
    *,
    expected_version: int | None = None,
) -> OperationView:
    """Fail an open operation whose controller cannot (recorded as forced, with the reason)."""
    if not reason.strip():
        raise Unprocessable("force-fail needs a reason", code="reason_required")

    async def act(op: OperationView) -> OperationView:
        return await fail(
            session,
            principal,
            op,
            f"forced by operator: {reason}",
            forced=True,
            message=f"operator force-failed {op.kind} {operation_id} ({reason})",
        )

    return await _recover(session, principal, operation_id, reason, expected_version, FORCE_FAIL, act)
