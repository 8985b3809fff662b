"""A controller's own state per instance on the platform (`/controller/instances/{id}/state`, the SDK's
`StoredState`): versioned compare-and-set between replicas, for the bound controller only, size-capped."""

from __future__ import annotations

import asyncio

import pytest

from gpuaas.sdk import ApiError
from gpuaas.sdk.controller import StoredState

from .conftest import World
from .test_runtime import deployed, expect

pytestmark = pytest.mark.integration


async def test_state_is_versioned_and_only_for_the_controller(rt, world: World) -> None:
    w = world
    iid, _ = await deployed(w)
    ctl = w.controller()

    empty = await ctl.controller_state(iid)
    assert (empty["state"], empty["version"], empty["updated_at"]) == ({}, 0, None)

    first = await ctl.put_controller_state(iid, {"ports": {"echo": 7000}}, 0)
    assert first["version"] == 1
    assert (await ctl.controller_state(iid))["state"] == {"ports": {"echo": 7000}}

    # A replica that read version 0 loses: it must re-read, not overwrite.
    await expect("state_version_conflict", 409, ctl.put_controller_state(iid, {"ports": {}}, 0))
    assert (await ctl.controller_state(iid))["state"] == {"ports": {"echo": 7000}}

    # Two replicas updating at once through StoredState: both changes land (the loser re-reads and re-applies).
    a, b = await StoredState.load(ctl, iid), await StoredState.load(ctl, iid)
    await asyncio.gather(
        a.update(lambda d: d.setdefault("nodes", []).append("a")),
        b.update(lambda d: d.setdefault("nodes", []).append("b")),
    )
    final = await ctl.controller_state(iid)
    assert sorted(final["state"]["nodes"]) == ["a", "b"] and final["version"] == 3

    # Only the instance's bound controller: another controller account, a user, another project.
    await expect("not_the_controller", 403, w.controller(w.sa_other).controller_state(iid))
    await expect("not_the_controller", 403, w.controller(w.sa_other).put_controller_state(iid, {}, 3))
    with pytest.raises(ApiError) as err:
        await w.user(w.admin).controller_state(iid)
    assert err.value.status == 403

    await expect("controller_state_too_large", 422, ctl.put_controller_state(iid, {"blob": "x" * 300_000}, 3))
    await expect("validation_error", 422, ctl.put_controller_state(iid, {}, -1))
    assert (await ctl.controller_state(iid))["version"] == 3
