"""Operators' recovery of member operations (`apps.operation.manage`): retry, cancel, force-fail.

If-Match names the operation's version (its `version` in a listing, or a previous answer's ETag); a
version that moved on is 412 `version_mismatch`. Each answers the operation with its new ETag.
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Response

from gpuaas.app_runtime import service
from gpuaas.app_runtime.api.schemas import PRECONDITION, Operation, Reason
from gpuaas.app_runtime.api.users import versioned
from gpuaas.app_runtime.service import OperationView
from gpuaas.kit import iam
from gpuaas.kit.app import Kit
from gpuaas.kit.auth import CurrentPrincipal
from gpuaas.kit.versioning import ExpectedVersion

router = APIRouter()


@router.post(
    "/operations/{operation_id}/retry",
    response_model=Operation,
    tags=["operations"],
    openapi_extra=iam.action_doc("apps.operation.manage"),
    responses=PRECONDITION,
)
async def retry_operation(
    operation_id: uuid.UUID,
    body: Reason,
    principal: CurrentPrincipal,
    kit: Kit,
    response: Response,
    expected: ExpectedVersion,
) -> OperationView:
    """If-Match names the operation's version (`version` in its listing, or a previous answer's ETag)."""
    async with kit.sessions() as session, session.begin():
        op = await service.retry_operation(session, principal, operation_id, body.reason, expected_version=expected)
    return versioned(response, op)


@router.post(
    "/operations/{operation_id}/cancel",
    response_model=Operation,
    tags=["operations"],
    openapi_extra=iam.action_doc("apps.operation.manage"),
    responses=PRECONDITION,
)
async def cancel_operation(
    operation_id: uuid.UUID,
    body: Reason,
    principal: CurrentPrincipal,
    kit: Kit,
    response: Response,
    expected: ExpectedVersion,
) -> OperationView:
    """If-Match names the operation's version (`version` in its listing, or a previous answer's ETag)."""
    async with kit.sessions() as session, session.begin():
        op = await service.cancel_operation(session, principal, operation_id, body.reason, expected_version=expected)
    return versioned(response, op)


@router.post(
    "/operations/{operation_id}/force-fail",
    response_model=Operation,
    tags=["operations"],
    openapi_extra=iam.action_doc("apps.operation.manage"),
    responses=PRECONDITION,
)
async def force_fail_operation(
    operation_id: uuid.UUID,
    body: Reason,
    principal: CurrentPrincipal,
    kit: Kit,
    response: Response,
    expected: ExpectedVersion,
) -> OperationView:
    async with kit.sessions() as session, session.begin():
        op = await service.force_fail_operation(
            session, principal, operation_id, body.reason, expected_version=expected
        )
    return versioned(response, op)
