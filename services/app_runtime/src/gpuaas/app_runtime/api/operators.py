"""Operators' recovery of member operations (`apps.operation.manage`): retry, cancel, force-fail.

If-Match names the operation's version (its `version` in a listing, or a previous answer's ETag); a
version that moved on is 412 `version_mismatch`. Each answers the operation with its new ETag.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from fastapi import APIRouter, Response
from fastapi.types import DecoratedCallable

from gpuaas.app_runtime import service
from gpuaas.app_runtime.api.calls import versioned_call
from gpuaas.app_runtime.api.schemas import PRECONDITION, Operation, Reason
from gpuaas.app_runtime.service import OperationView
from gpuaas.kit import iam
from gpuaas.kit.app import Kit
from gpuaas.kit.auth import CurrentPrincipal
from gpuaas.kit.versioning import ExpectedVersion

router = APIRouter()


def _recovery(path: str) -> Callable[[DecoratedCallable], DecoratedCallable]:
    return router.post(
        path,
        response_model=Operation,
        tags=["operations"],
        openapi_extra=iam.action_doc("apps.operation.manage"),
        responses=PRECONDITION,
    )


@_recovery("/operations/{operation_id}/retry")
async def retry_operation(
    operation_id: uuid.UUID,
    body: Reason,
    principal: CurrentPrincipal,
    kit: Kit,
    response: Response,
    expected: ExpectedVersion,
) -> OperationView:
    """If-Match names the operation's version (`version` in its listing, or a previous answer's ETag)."""
    return await versioned_call(
        kit, response, service.retry_operation, principal, operation_id, body.reason, expected=expected
    )


@_recovery("/operations/{operation_id}/cancel")
async def cancel_operation(
    operation_id: uuid.UUID,
    body: Reason,
    principal: CurrentPrincipal,
    kit: Kit,
    response: Response,
    expected: ExpectedVersion,
) -> OperationView:
    """If-Match names the operation's version (`version` in its listing, or a previous answer's ETag)."""
    return await versioned_call(
        kit, response, service.cancel_operation, principal, operation_id, body.reason, expected=expected
    )


@_recovery("/operations/{operation_id}/force-fail")
async def force_fail_operation(
    operation_id: uuid.UUID,
    body: Reason,
    principal: CurrentPrincipal,
    kit: Kit,
    response: Response,
    expected: ExpectedVersion,
) -> OperationView:
    return await versioned_call(
        kit, response, service.force_fail_operation, principal, operation_id, body.reason, expected=expected
    )
