"""Seed apps: slurm-reference (controller), jupyter (launchable), vllm (oci), rke2-self-managed
(controller), with honest version labels.

`version` is the GPUaaS app's own version; `runtime_version` is what the app installs. The seeded
artifacts are small placeholder images (a README that says so) pushed with fixed bytes, so their
digests are stable; each goes through the real lifecycle (content verification, recorded lint/smoke,
staged, canary for the given tenants, active) and the manifests' descriptions say they are placeholders.

`seed_catalog` is idempotent: run it again and it only completes what is missing.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gpuaas.catalog import service
from gpuaas.catalog.models import artifacts, entitlements, manifests
from gpuaas.catalog.oci import RegistryClient, TrustError
from gpuaas.catalog.service.common import trust_problem
from gpuaas.contracts.events.catalog import ArtifactKind, ArtifactLifecycle
from gpuaas.kit import iam
from gpuaas.kit.auth import Principal

PLACEHOLDER = "Seed placeholder artifact: the image holds only this README and installs nothing."


def _readme(slug: str, installs: str) -> bytes:
    return f"# {slug}\n\n{PLACEHOLDER}\nThe real {slug} artifact would install {installs}.\n".encode()


SEED_APPS: list[dict[str, Any]] = [
    {
        "repository": "gpuaas/slurm-reference-controller",
        "installs": "Slurm 22.05 (Debian 12 slurm-wlm) through the reference controller",
        "manifest": {
            "slug": "slurm-reference",
            "display_name": "Slurm (reference controller)",
            "description": "Slurm cluster driven by the slurm-reference app controller: controller and workers "
            "as members of your allocations. " + PLACEHOLDER,
            "version": "1.0.0",
            "runtime_version": "Slurm 22.05",
            "artifact_kind": "controller",
            "compatibility": {
                "requires_capacity_shape": ["baremetal", "gpu_slice"],
                "min_gpu_count": 1,
                "requires_exclusive_node": False,
                "multi_allocation": True,
            },
            "inputs": {
                "type": "object",
                "properties": {
                    "cluster_name": {"type": "string", "pattern": "^[a-z][a-z0-9-]{0,31}$", "default": "gpuaas"},
                    "partition": {"type": "string", "default": "gpu"},
                },
                "required": ["cluster_name"],
                "additionalProperties": False,
            },
            "roles": [
                {"key": "controller", "display_name": "Controller", "description": "slurmctld"},
                # slurmd workers join slurmctld: brought up after it, taken away before it (the runtime's order)
                {"key": "worker", "display_name": "Worker", "description": "slurmd", "after": ["controller"]},
            ],
        },
    },
    {
        "repository": "gpuaas/jupyter",
        "installs": "JupyterLab 4.2",
        "manifest": {
            "slug": "jupyter",
            "display_name": "Jupyter",
            "description": "JupyterLab as a launchable OCI workload in one allocation. " + PLACEHOLDER,
            "version": "1.0.0",
            "runtime_version": "JupyterLab 4.2",
            "artifact_kind": "launchable",
            "compatibility": {
                "requires_capacity_shape": ["baremetal", "gpu_slice"],
                "min_gpu_count": 1,
                "requires_exclusive_node": False,
                "multi_allocation": False,
            },
            "runtime_profile": {
                "command": ["jupyter", "lab", "--ip=0.0.0.0", "--port=8888", "--no-browser"],
                "ports": [{"name": "http", "container_port": 8888, "protocol": "tcp", "http": True}],
                "resources": {"gpu_count": 1, "memory_mb": 16384},
                "volumes": [{"name": "work", "mount_path": "/home/jovyan/work"}],
                "healthcheck": {"http_path": "/api", "port": 8888, "initial_delay_s": 5, "period_s": 10},
            },
            "inputs": {"type": "object", "properties": {}, "additionalProperties": False},
            "roles": [],
        },
    },
    {
        "repository": "gpuaas/vllm",
        "installs": "vLLM 0.6.3 (OpenAI-compatible server)",
        "manifest": {
            "slug": "vllm",
            "display_name": "vLLM",
            "description": "vLLM OpenAI-compatible inference server (OCI image). " + PLACEHOLDER + " To be real it "
            "lacks: an image with vLLM and a CUDA build of PyTorch (several GB), a CUDA GPU to run on (none here, so "
            "it was never run), and a launchable workload (port 8000, health /health) like jupyter's.",
            "version": "1.0.0",
            "runtime_version": "vLLM 0.6.3",
            "artifact_kind": "oci",
            "compatibility": {
                "requires_capacity_shape": ["baremetal", "gpu_slice"],
                "min_gpu_count": 1,
                "requires_exclusive_node": False,
                "multi_allocation": False,
            },
            "inputs": {
                "type": "object",
                "properties": {
                    "model": {"type": "string", "minLength": 1, "description": "Hugging Face model id"},
                    "max_model_len": {"type": "integer", "minimum": 256},
                },
                "required": ["model"],
                "additionalProperties": False,
            },
            "roles": [],
        },
    },
    {
        "repository": "gpuaas/rke2-self-managed-controller",
        "installs": "RKE2 v1.30 (Kubernetes 1.30) through the rke2-self-managed controller",
        "manifest": {
            "slug": "rke2-self-managed",
            "display_name": "RKE2 (self-managed)",
            "description": "A self-managed RKE2 Kubernetes control plane in one allocation, driven by its app "
            "controller. Multi-node clusters are not offered yet. " + PLACEHOLDER + " To be real it lacks: the "
            "RKE2 binaries (GitHub releases, unreachable here), allocations that may run privileged system "
            "services (kernel modules, cgroup delegation: the isolated containers refuse them) and the controller.",
            "version": "1.0.0",
            "runtime_version": "RKE2 v1.30",
            "artifact_kind": "controller",
            "compatibility": {
                "requires_capacity_shape": ["baremetal", "gpu_slice"],
                "min_gpu_count": 1,
                "requires_exclusive_node": False,
                "multi_allocation": False,
            },
            "inputs": {
                "type": "object",
                "properties": {"cluster_name": {"type": "string", "pattern": "^[a-z][a-z0-9-]{0,31}$"}},
                "required": ["cluster_name"],
                "additionalProperties": False,
            },
            "roles": [
                {"key": "server", "display_name": "Server", "description": "rke2 server (control plane)"},
                {"key": "agent", "display_name": "Agent", "description": "rke2 agent"},
            ],
        },
    },
]

_PATH = [ArtifactLifecycle.staged, ArtifactLifecycle.canary, ArtifactLifecycle.active]


class SeededApp(BaseModel):
    artifact_ref: str
    manifest_id: str


async def seed_catalog(
    sessions: async_sessionmaker[AsyncSession],
    client: RegistryClient,
    principal: Principal,
    *,
    registry: str,
    tenant_ids: list[uuid.UUID],
) -> dict[str, SeededApp]:
    """Push, register, verify, promote, activate and entitle the seed apps (idempotent).

    `principal` must be allowed to register apps (a platform operator); `tenant_ids` get the canary
    exposure and the entitlements. A registry failure is the request's problem (TrustError's status)."""
    async with sessions() as session:
        await iam.authorize(session, principal, "catalog.app.register")
    seeded: dict[str, SeededApp] = {}
    try:
        for app in SEED_APPS:
            seeded[app["manifest"]["slug"]] = await _seed_app(sessions, client, principal, app, registry, tenant_ids)
    except TrustError as exc:
        raise trust_problem(exc) from None
    return seeded


async def _seed_app(
    sessions: async_sessionmaker[AsyncSession],
    client: RegistryClient,
    principal: Principal,
    app: dict[str, Any],
    registry: str,
    tenant_ids: list[uuid.UUID],
) -> SeededApp:
    m = dict(app["manifest"])
    ref = await client.push_image(
        registry,
        app["repository"],
        {"README.md": _readme(m["slug"], app["installs"])},
        tag=m["version"],
        labels={
            "org.opencontainers.image.description": PLACEHOLDER,
            "org.opencontainers.image.version": m["version"],
        },
    )
    m["artifact_ref"] = ref.ref
    if m.get("runtime_profile") is not None:
        m["runtime_profile"] = {"image": ref.ref, **m["runtime_profile"]}
    async with sessions() as session:
        row = (await session.execute(select(artifacts).where(artifacts.c.ref == ref.ref))).first()
    if row is None:
        verified = await client.verify(ref)
        async with sessions() as session, session.begin():
            artifact = await service.register_artifact(
                session, principal, kind=ArtifactKind.oci, verified=verified, signature=None
            )
        artifact_id, state = artifact.artifact_id, ArtifactLifecycle.draft
    else:
        artifact_id, state = row.artifact_id, ArtifactLifecycle(row.state)
    if state is ArtifactLifecycle.draft:
        for name in ("lint", "smoke"):
            async with sessions() as session, session.begin():
                await service.record_check(
                    session,
                    principal,
                    artifact_id,
                    name=name,
                    passed=True,
                    detail=f"seed: {name} of a placeholder artifact (content verified; nothing to run)",
                )
    for target in _PATH:
        if state in (ArtifactLifecycle.deprecated, ArtifactLifecycle.retired):
            break  # an operator has moved it on since: leave it
        if _PATH.index(target) <= (_PATH.index(state) if state in _PATH else -1):
            continue
        verified = await client.verify(ref)
        async with sessions() as session, session.begin():
            await service.transition_artifact(
                session,
                principal,
                artifact_id,
                target=target,
                reason="seed",
                canary_tenants=tenant_ids,
                expected_version=None,
                reverified=verified,
            )
        state = target
    async with sessions() as session:
        existing = (
            await session.execute(
                select(manifests.c.manifest_id).where(
                    manifests.c.slug == m["slug"], manifests.c.version == m["version"]
                )
            )
        ).first()
    if existing is None:
        async with sessions() as session, session.begin():
            manifest = await service.register_manifest(session, principal, {**m, "active": True})
        manifest_id = manifest.manifest_id
    else:
        manifest_id = existing[0]
    for tenant_id in tenant_ids:
        async with sessions() as session:
            granted = (
                await session.execute(
                    select(entitlements.c.status).where(
                        entitlements.c.tenant_id == tenant_id, entitlements.c.app_slug == m["slug"]
                    )
                )
            ).first()
        if granted is None or granted.status != "granted":
            async with sessions() as session, session.begin():
                await service.grant_entitlement(session, principal, tenant_id=tenant_id, app_slug=m["slug"])
    return SeededApp(artifact_ref=ref.ref, manifest_id=str(manifest_id))
