"""Launchable apps (issue 21): an OCI workload with a port and a health path, run in an allocation the
deploy creates, opened in the browser through the gateway's `/apps/{instance_id}/`.

- Deploy (`placement_intent.mode = "launch"`): the manifest's `runtime_profile` (image pinned by digest,
  command, first HTTP port, health check, `auth`) becomes a `LaunchRequest` on the instance (kept in
  `runtime_detail.launch`, carried by `instance.created`); allocations creates that allocation on a container
  host and the node agent starts the workload. No controller, no member operations, no SSH credential.
- The instance follows its allocation (allocations' events): `starting` while it provisions, `running` once
  the agent reported the workload healthy (`workload_endpoint`), `failed` when the allocation failed, and
  `decommissioned` once it is released after a decommission (a release by anyone else: `failed`).
- `workload_upstream`: where the gateway forwards `/apps/{instance_id}/` — only for a caller allowed
  `apps.instance.open` in the instance's project, only to the enrolled host's address, audited by the
  gateway's open (`audit=True`).
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.app_runtime import domain
from gpuaas.app_runtime.service.common import (
    audit_on,
    load_instance,
    readable_instance,
    set_instance_status,
    timeline,
)
from gpuaas.app_runtime.service.instance_records import create_instance
from gpuaas.app_runtime.service.lifecycle import check_decommission
from gpuaas.app_runtime.service.views import InstanceView, ManifestView
from gpuaas.contracts import Actor, new_event_id
from gpuaas.contracts.enums import AllocationStatus, InstanceStatus
from gpuaas.contracts.events.allocations import AllocationState, WorkloadSpec
from gpuaas.contracts.events.app_runtime import LaunchRequest, PlacementIntent
from gpuaas.kit import iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, NotFound, Unprocessable

OPEN_ACTION = "apps.instance.open"


def is_launchable(manifest: ManifestView) -> bool:
    return manifest.state.get("artifact_kind") == "launchable"


def base_path(instance_id: uuid.UUID) -> str:
    return f"/apps/{instance_id}/"


def workload_of(manifest: ManifestView, instance_id: uuid.UUID) -> WorkloadSpec:
    """The workload a launchable manifest declares (its runtime_profile), for this instance."""
    profile = manifest.state.get("runtime_profile") or {}
    http_ports = [p for p in profile.get("ports") or [] if p.get("http", True) and p.get("protocol", "tcp") == "tcp"]
    health = profile.get("healthcheck") or {}
    port = int(health.get("port") or (http_ports[0]["container_port"] if http_ports else 0))
    if not port or not profile.get("command"):
        raise Unprocessable(
            f"{manifest.slug} {manifest.app_version} declares no workload command and HTTP port",
            code="app_not_launchable",
        )
    auth = profile.get("auth") or {}
    return WorkloadSpec(
        instance_id=instance_id,
        command=list(profile["command"]) + list(profile.get("args") or []),
        port=port,
        health_path=str(health.get("http_path") or "/"),
        base_path=base_path(instance_id),
        env={str(k): str(v) for k, v in (profile.get("env") or {}).items()},
        auth_env=auth.get("env"),
        auth_header=str(auth.get("header") or "Authorization"),
        auth_scheme=str(auth.get("scheme") if auth.get("scheme") is not None else "token"),
    )


def launch_request(
    manifest: ManifestView, placement: PlacementIntent, instance_id: uuid.UUID, principal: Principal
) -> tuple[PlacementIntent, LaunchRequest]:
    if placement.mode != "launch" or placement.controller_allocation_id or placement.worker_allocation_ids:
        raise Unprocessable(
            f"{manifest.slug} is a launchable app: deploy it with placement_intent "
            '{"mode": "launch", "gpu_model": ..., "gpu_count": ...} (it gets its own allocation)',
            code="placement_invalid",
        )
    if not placement.gpu_model:
        raise Unprocessable("placement_intent.gpu_model is required to launch an app", code="placement_invalid")
    min_gpus = int((manifest.state.get("compatibility") or {}).get("min_gpu_count") or 0)
    gpus = placement.gpu_count or max(1, min_gpus)
    if gpus < min_gpus:
        raise Unprocessable(f"{manifest.slug} needs at least {min_gpus} GPU(s)", code="incompatible_placement")
    allocation_id = new_event_id()
    workload = workload_of(manifest, instance_id)
    intent = placement.model_copy(update={"gpu_count": gpus, "launch_allocation_id": allocation_id})
    request = LaunchRequest(
        allocation_id=allocation_id,
        owner_user_id=None if principal.is_service_account else principal.subject,
        gpu_model=placement.gpu_model,
        gpu_count=gpus,
        app_slug=manifest.slug,
        app_version=manifest.app_version,
        image=manifest.artifact_ref,
        digest=manifest.digest,
        workload=workload.model_dump(mode="json"),
    )
    return intent, request


def workload_view(launch: LaunchRequest, endpoint: dict[str, Any] | None) -> dict[str, Any]:
    """`runtime_detail.workload`: what the console's Open button needs (the endpoint stays server-side)."""
    return {
        "allocation_id": str(launch.allocation_id),
        "port": launch.workload["port"],
        "health_path": launch.workload["health_path"],
        "healthy": bool(endpoint and endpoint.get("healthy")),
        "open_path": launch.workload["base_path"],
    }


async def deploy_launchable(
    session: AsyncSession,
    principal: Principal,
    *,
    tenant_id: uuid.UUID,
    project_id: uuid.UUID,
    name: str,
    manifest: ManifestView,
    config: dict[str, Any],
    placement: PlacementIntent,
) -> InstanceView:
    """The instance of a launchable app (permission, entitlement and manifest state already checked)."""
    domain.validate_config(manifest.state.get("inputs") or {"type": "object"}, config)
    instance_id = new_event_id()
    intent, request = launch_request(manifest, placement, instance_id, principal)
    actor = principal.actor
    inst = await create_instance(
        session,
        instance_id=instance_id,
        tenant_id=tenant_id,
        project_id=project_id,
        name=name,
        manifest=manifest,
        placement_intent=intent.model_dump(mode="json"),
        config=config,
        runtime_detail={"launch": request.model_dump(mode="json"), "workload": workload_view(request, None)},
        actor=actor,
    )
    await timeline(
        session,
        inst.instance_id,
        "instance.created",
        f"launched {manifest.slug} {manifest.app_version}: allocation {request.allocation_id} "
        f"({request.gpu_count} x {request.gpu_model}) from {request.image}",
        actor,
    )
    await audit_on(
        session,
        principal,
        "apps.instance.deploy",
        inst,
        after={"app": manifest.slug, "version": manifest.app_version, "placement": intent.model_dump(mode="json")},
    )
    return inst


# ------------------------------------------------------------------------------ following the allocation


async def allocation_changed(session: AsyncSession, state: AllocationState, actor: Actor) -> None:
    """Move a launchable instance along with its allocation (called from the allocations projection)."""
    if state.workload is None:
        return
    try:
        inst = await load_instance(session, state.workload.instance_id, lock=True)
    except NotFound:
        return
    launch = LaunchRequest.model_validate(inst.runtime_detail.get("launch") or {})
    if launch.allocation_id != state.allocation_id:
        return
    endpoint = state.workload_endpoint.model_dump(mode="json") if state.workload_endpoint else None
    detail = {**inst.runtime_detail, "workload": workload_view(launch, endpoint), "endpoint": endpoint}
    status = InstanceStatus(inst.status)
    decommissioning = status is InstanceStatus.decommissioning
    live = status in (InstanceStatus.created, InstanceStatus.starting, InstanceStatus.running)

    async def fail(message: str, reason: str) -> None:
        await set_instance_status(
            session, inst, InstanceStatus.failed, actor, message, runtime_detail=detail, failure_reason=reason
        )

    if state.status == AllocationStatus.provisioning and status is InstanceStatus.created:
        await set_instance_status(
            session, inst, InstanceStatus.starting, actor, "allocation provisioning", runtime_detail=detail
        )
    elif state.status == AllocationStatus.active and endpoint and endpoint.get("healthy") and not decommissioning:
        if status in (InstanceStatus.created, InstanceStatus.starting, InstanceStatus.degraded):
            await set_instance_status(
                session,
                inst,
                InstanceStatus.running,
                actor,
                f"workload healthy ({launch.workload['health_path']} answered)",
                runtime_detail=detail,
                health={
                    "status": "healthy",
                    "message": "health check answered",
                    "checked_at": state.status_changed_at.isoformat(),
                },
            )
    elif state.status == AllocationStatus.failed and live:
        reason = state.failure_reason or "the app's allocation failed"
        await fail(f"allocation failed: {state.failure_reason or 'no reason given'}", reason)
    elif state.status in (AllocationStatus.releasing, AllocationStatus.released, AllocationStatus.failed):
        if decommissioning and state.status != AllocationStatus.releasing:
            await check_decommission(session, inst.instance_id, actor)
        elif not decommissioning and live:
            await fail("the app's allocation was released", "the app's allocation was released")


# ------------------------------------------------------------------------------ the gateway's look-up


async def workload_upstream(
    session: AsyncSession, principal: Principal, instance_id: uuid.UUID, *, audit: bool
) -> dict[str, Any]:
    """Where the gateway may forward `/apps/{instance_id}/` for this caller: the enrolled host address and
    the published port, the base path and how to present the secret. 404 when the caller cannot see the
    instance, 403 without `apps.instance.open`, 409 `workload_not_ready` while it is not running."""
    inst = await readable_instance(session, principal, instance_id)
    await iam.authorize(session, principal, OPEN_ACTION, project_id=inst.project_id)
    launch = inst.runtime_detail.get("launch")
    endpoint = inst.runtime_detail.get("endpoint")
    if not launch:
        raise NotFound("this instance has no browser workload", code="workload_not_found")
    if inst.status != InstanceStatus.running or not endpoint or not endpoint.get("healthy"):
        raise Conflict(
            f"the app is {inst.status}, not running yet", code="workload_not_ready", instance_status=str(inst.status)
        )
    workload = launch["workload"]
    if audit:
        await audit_on(session, principal, OPEN_ACTION, inst, after={"path": workload["base_path"]})
        await timeline(session, inst.instance_id, "instance.opened", "opened in the browser", principal.actor)
    return {
        "instance_id": str(inst.instance_id),
        "project_id": str(inst.project_id),
        "host": endpoint["host"],
        "port": int(endpoint["port"]),
        "base_path": workload["base_path"],
        "auth_header": workload.get("auth_header") or "Authorization",
        "auth_scheme": workload.get("auth_scheme", "token"),
        "authenticated": bool(workload.get("auth_env")),
    }
