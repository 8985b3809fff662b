"""Rules a new app team hit (issue 19): an `add` names one of the manifest's roles and never a second
controller; a planned removal is not a degradation; a decommissioned instance no longer claims to be
healthy; a controller binding names an app that exists. Driven with the SDK's low-level lease calls so
each step (claimed, completed) can be observed."""

from __future__ import annotations

import uuid

import pytest

from gpuaas.sdk import Client

from .conftest import World
from .test_runtime import deployed, expect

pytestmark = pytest.mark.integration


async def finish_open_operations(w: World, ctl: Client) -> list[str]:
    """Claim and complete every claimable operation of the app (teardown verified); their kinds."""
    done = []
    while (claim := await ctl.claim(w.slug)) is not None:
        op = claim.operation
        await ctl.complete(op.operation_id, claim.lease_token, result={"teardown_verified": True, "evidence": "ok"})
        done.append(op.kind)
    return done


async def test_add_names_a_manifest_role_and_never_a_second_controller(rt, world: World) -> None:
    w = world
    user, ctl = w.user(w.admin), w.controller()
    instance_id, _ = await deployed(w)
    assert sorted(await finish_open_operations(w, ctl)) == ["add", "add"]
    extra = await w.allocation()

    err = await expect(
        "unknown_component_key",
        422,
        user.request_operation(instance_id, "add", allocation_id=extra, component_key="slurmdbd"),
    )
    assert err.problem["roles"] == ["slurmctld", "slurmd"]
    # the same rule for the controller itself
    await expect(
        "unknown_component_key",
        422,
        ctl.request_operation(instance_id, "add", allocation_id=extra, component_key="nope", as_controller=True),
    )
    err = await expect(
        "controller_member_exists",
        409,
        user.request_operation(instance_id, "add", allocation_id=extra, component_key="slurmctld"),
    )
    assert "replace" in err.problem["detail"]
    # nothing was created by the refusals; a worker role is still accepted
    assert len(await user.members(instance_id)) == 2
    op = await user.request_operation(instance_id, "add", allocation_id=extra, component_key="slurmd")
    assert op.component_key == "slurmd"


async def test_a_planned_worker_removal_keeps_the_instance_running(rt, world: World) -> None:
    w = world
    user, ctl = w.user(w.admin), w.controller()
    instance_id, (_a_ctl, a_w1) = await deployed(w)
    await finish_open_operations(w, ctl)
    assert (await user.instance(instance_id)).status == "running"
    worker = next(m for m in await user.members(instance_id) if m.allocation_id == a_w1)

    await user.request_operation(instance_id, "remove", member_id=worker.member_id)
    claim = await ctl.claim(w.slug)
    assert claim is not None and claim.operation.kind == "remove"
    stopping = next(m for m in await user.members(instance_id) if m.member_id == worker.member_id)
    assert stopping.status == "stopping"
    assert (await user.instance(instance_id)).status == "running"  # was: degraded
    await ctl.complete(claim.operation.operation_id, claim.lease_token, result={"teardown_verified": True})
    inst = await user.instance(instance_id)
    assert inst.status == "running"
    assert "instance.degraded" not in [e.kind for e in await user.timeline(instance_id)]
    # a member that really fails still degrades it
    ctl_member = (await user.members(instance_id))[0]
    await ctl.report_member(ctl_member.member_id, status="failed")
    assert (await user.instance(instance_id)).status == "degraded"


async def test_a_decommissioned_instance_no_longer_reports_healthy(rt, world: World) -> None:
    w = world
    user, ctl = w.user(w.admin), w.controller()
    instance_id, _ = await deployed(w)
    await finish_open_operations(w, ctl)
    await ctl.report_instance(instance_id, health={"status": "healthy", "message": "2 member(s) serving"})
    assert (await user.instance(instance_id)).health.status == "healthy"

    await user.decommission(instance_id, "finished")
    assert sorted(await finish_open_operations(w, ctl)) == ["remove", "remove"]
    inst = await user.instance(instance_id)
    assert inst.status == "decommissioned"
    assert inst.health.status == "unknown" and "serving" not in inst.health.message
    assert "decommissioned" in inst.health.message
    events = await rt.outbox("instance.decommissioned", instance_id)
    assert events[-1]["data"]["health"]["status"] == "unknown"


async def test_a_forced_decommission_clears_health_too(rt, world: World) -> None:
    w = world
    user, ctl = w.user(w.admin), w.controller()
    instance_id, _ = await deployed(w)
    await finish_open_operations(w, ctl)
    await ctl.report_instance(instance_id, health={"status": "healthy", "message": "2 member(s) serving"})
    await user.decommission(instance_id, "finished")
    forced = await user.force_decommission(instance_id, "controller lost")
    assert forced.status == "decommissioned" and forced.health.status == "unknown"


async def test_binding_a_controller_to_an_unknown_app_is_refused(rt, world: World) -> None:
    w = world
    user = w.user(w.admin)
    err = await expect("app_not_found", 404, user.bind_controller(w.project, f"nope-{uuid.uuid4().hex[:6]}", w.sa))
    assert "nope-" in err.problem["detail"]
    bound = await user.bind_controller(w.project, w.slug, w.sa)
    assert bound["app_slug"] == w.slug


async def test_permission_denied_names_the_roles_that_hold_the_permission(rt, world: World) -> None:
    w = world
    err = await expect("permission_denied", 403, w.user(w.viewer).bind_controller(w.project, w.slug, w.sa))
    assert err.problem["permission"] == "apps.instance.manage"
    assert err.problem["roles"] == ["platform_admin", "tenant_admin", "project_admin"]
    assert "project_admin" in err.problem["detail"]
