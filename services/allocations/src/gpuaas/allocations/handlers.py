"""Events allocations consumes from app-runtime and identity (in the consumer's transaction; no network).

- identity: a user disabled or a membership revoked: that person's keys leave every live allocation and the
  agent closes their open SSH sessions (service/access.py `access_of_user_changed`);

- access grants: the instance controller's public key becomes SSH grants on the listed allocations;
- members: a projection of which allocations carry live app members (release saga);
- release clearance: app-runtime stopped the members on an allocation: the release proceeds;
- launchable instances (issue 21): the allocation their workload runs in is created / released here.

And from catalog: runtime manifests and the artifacts they pin (what allocation create resolves
`runtime` against, without calling catalog).
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations import service
from gpuaas.contracts.events import app_runtime as app_runtime_events
from gpuaas.contracts.events import catalog as catalog_events
from gpuaas.contracts.events import identity as identity_events
from gpuaas.kit.subscriptions import Subscriptions

subscriptions = Subscriptions()


@subscriptions.on(identity_events.UserUpdated)
async def on_user_updated(session: AsyncSession, e: identity_events.UserUpdated) -> None:
    """A disabled user's keys leave every live allocation (kit.iam has projected the status already)."""
    await service.access_of_user_changed(session, e.data.user_id, f"user {e.data.status}")


@subscriptions.on(identity_events.MembershipRevoked, identity_events.MembershipChanged)
async def on_membership_changed(
    session: AsyncSession, e: identity_events.MembershipRevoked | identity_events.MembershipChanged
) -> None:
    """A member removed from a project (or its tenant) loses SSH into the project's allocations."""
    await service.access_of_user_changed(session, e.data.user_id, f"membership {e.type.split('.')[-1]}")


@subscriptions.on(app_runtime_events.AccessGrantRequested, app_runtime_events.AccessGrantUpdated)
async def on_access_grant(session: AsyncSession, e: app_runtime_events.AccessGrantRequested) -> None:
    await service.apply_access_grant(session, e.data, revoked=False, actor=e.actor)


@subscriptions.on(app_runtime_events.AccessGrantRevoked)
async def on_access_grant_revoked(session: AsyncSession, e: app_runtime_events.AccessGrantRevoked) -> None:
    await service.apply_access_grant(session, e.data, revoked=True, actor=e.actor)


@subscriptions.on(app_runtime_events.MemberAdded, app_runtime_events.MemberUpdated, app_runtime_events.MemberTombstoned)
async def on_member(session: AsyncSession, e: app_runtime_events.MemberAdded) -> None:
    await service.record_app_member(session, e.data, tombstoned=e.type == "member.tombstoned")


@subscriptions.on(app_runtime_events.ReleaseClearanceGranted)
async def on_release_clearance(session: AsyncSession, e: app_runtime_events.ReleaseClearanceGranted) -> None:
    d = e.data
    note = f"app-runtime stopped {len(d.stopped_member_ids)} member(s)" + (" (forced)" if d.forced else "")
    await service.clearance_granted(session, d.allocation_id, forced=d.forced, note=note)


@subscriptions.on(app_runtime_events.InstanceCreated)
async def on_instance_created(session: AsyncSession, e: app_runtime_events.InstanceCreated) -> None:
    """A launchable instance: create its allocation (service/launch.py)."""
    await service.launch_allocation(session, e.data, e.actor)


@subscriptions.on(app_runtime_events.InstanceDecommissioning)
async def on_instance_decommissioning(session: AsyncSession, e: app_runtime_events.InstanceDecommissioning) -> None:
    await service.release_launch_allocation(session, e.data, e.actor)


@subscriptions.on(catalog_events.AppRegistered, catalog_events.AppUpdated, catalog_events.AppDeprecated)
async def on_manifest(session: AsyncSession, e: catalog_events.AppRegistered) -> None:
    await service.record_runtime_manifest(session, e.data, deprecated=e.type == "app.deprecated")


@subscriptions.on(
    catalog_events.ArtifactRegistered, catalog_events.ArtifactUpdated, catalog_events.ArtifactTransitioned
)
async def on_artifact(session: AsyncSession, e: catalog_events.ArtifactRegistered) -> None:
    await service.record_artifact(session, e.data)
