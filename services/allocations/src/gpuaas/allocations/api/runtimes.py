"""What an allocation's container runs with: the runtimes a create may choose (users) and the host
classes' default runtime and resource figures (operators).

    GET /runtimes?project_id=       offered runtimes (with the project: its tenant's canaries too)
    GET /host-classes               every class's figures
    PUT /host-classes/{name}        create or replace a class's figures (audited)
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path

from gpuaas.allocations import service
from gpuaas.allocations.api.schemas import HostClass, HostClassBody, RuntimeOption
from gpuaas.kit import iam
from gpuaas.kit.app import Kit
from gpuaas.kit.auth import CurrentPrincipal, Principal
from gpuaas.kit.iam import action_doc, require

router = APIRouter()
Operator = Annotated[Principal, Depends(require("allocations.host.read"))]


@router.get("/runtimes", response_model=list[RuntimeOption], tags=["allocations"])
async def list_runtimes(kit: Kit, principal: CurrentPrincipal, project_id: uuid.UUID | None = None) -> Any:
    """Runtime images a new allocation may name in `runtime` (newest version first per slug), as the
    catalog published them; with `project_id`, also the canaries exposed to the project's tenant."""
    async with kit.sessions() as session:
        tenant_id = None
        if project_id is not None:
            await iam.authorize(session, principal, "allocations.read", project_id=project_id)
            tenant_id = await iam.project_tenant(session, project_id)
        return await service.offered_runtimes(session, tenant_id)


@router.get("/host-classes", response_model=list[HostClass], tags=["hosts"])
async def list_host_classes(kit: Kit, _: Operator) -> Any:
    async with kit.sessions() as session:
        return await service.list_host_classes(session)


@router.put(
    "/host-classes/{name}",
    response_model=HostClass,
    tags=["hosts"],
    description="Limits of an allocation's container: cpus_per_gpu / memory_mb_per_gpu x its GPUs where set, "
    "else its share of the host (host figure x its GPUs / the host's GPUs); pids_limit always.",
    openapi_extra=action_doc("allocations.host.manage"),
)
async def put_host_class(
    kit: Kit,
    body: HostClassBody,
    principal: CurrentPrincipal,
    name: str = Path(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$"),
) -> Any:
    async with kit.sessions() as session, session.begin():
        return await service.put_host_class(
            session,
            principal,
            name,
            default_runtime=body.default_runtime,
            cpus_per_gpu=body.cpus_per_gpu,
            memory_mb_per_gpu=body.memory_mb_per_gpu,
            pids_limit=body.pids_limit,
        )
