"""Optimistic concurrency on app instances and member operations (ARCHITECTURE §11), over real HTTP:
`GET /instances/{id}` answers the instance's version as its ETag; every instance mutation (and an
operation request on the instance) takes an optional If-Match with it, every operator action on an
operation takes the operation's. A stale If-Match is 412 `version_mismatch` and writes nothing; of two
concurrent writers that read the same version exactly one wins; a malformed one is 422 `if_match_invalid`.
The checks every versioned service shares are gpuaas.kit.testing_versioning's; this file says what to send."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from gpuaas.kit.testing_versioning import (
    MALFORMED_IF_MATCH,
    Send,
    assert_all_malformed_rejected,
    assert_all_stale,
    etag_version,
    exactly_one_wins,
    if_match,
    version_of,
)

from .conftest import DIGEST2, World
from .test_runtime import deployed

pytestmark = pytest.mark.integration


@asynccontextmanager
async def http(w: World, who: uuid.UUID, **token: Any) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {w.rt.signer.token(who, **token)}"}
    async with httpx.AsyncClient(base_url=w.rt.url, headers=headers, timeout=30) as c:
        yield c


def controller_http(w: World) -> Any:
    return http(w, w.sa, kind="service_account", project_id=str(w.project), scope="app-controller")


async def snapshot(w: World, instance_id: uuid.UUID) -> dict[str, Any]:
    """Everything a mutation of the instance could write: its row, its members and operations, its
    timeline, and the outbox (events and audit records)."""

    async def rows(sql: str) -> list[dict[str, Any]]:
        async with w.rt.kit.sessions() as s:
            return [dict(r._mapping) for r in (await s.execute(text(sql), {"i": instance_id})).all()]

    # The outbox rows about this instance, its members and its operations (a new operation would show in the
    # operations rows too): the module's runtime also consumes the other suites' events from the shared broker and
    # may write rows about them meanwhile (seen once the capacity property test published thousands).
    about = (
        "SELECT max(seq) AS seq, count(*) AS n FROM outbox WHERE aggregate_id::text IN ("
        "SELECT CAST(:i AS uuid)::text UNION SELECT member_id::text FROM members WHERE instance_id = CAST(:i AS uuid) "
        "UNION SELECT operation_id::text FROM operations WHERE instance_id = CAST(:i AS uuid))"
    )
    async with w.rt.kit.sessions() as s:
        outbox = dict((await s.execute(text(about), {"i": instance_id})).one()._mapping)
    assert outbox["n"] > 0  # the instance's own events are seen (the filter is not vacuous)

    return {
        "instance": await rows("SELECT * FROM instances WHERE instance_id = :i"),
        "members": await rows("SELECT * FROM members WHERE instance_id = :i ORDER BY member_id"),
        "operations": await rows("SELECT * FROM operations WHERE instance_id = :i ORDER BY operation_id"),
        "timeline": await rows("SELECT max(seq) AS seq FROM instance_events WHERE instance_id = :i"),
        "outbox": outbox,
    }


def post_with(c: httpx.AsyncClient, path: str, body: dict[str, Any] | None, version: int) -> Send:
    """A POST of `body` with `version` as its If-Match, sent when called."""
    return lambda: c.post(path, json=body, headers=if_match(version))


@pytest.fixture
async def upgradable(world: World) -> uuid.UUID:
    """A deployed instance (on 1.0) with versions 2.0 and 2.1 to upgrade to."""
    instance_id, _ = await deployed(world)
    await world.manifest("2.0", digest=DIGEST2)
    await world.manifest("2.1", digest=DIGEST2)
    return instance_id


async def instance_version(c: httpx.AsyncClient, instance_id: uuid.UUID) -> int:
    return await version_of(c, f"/instances/{instance_id}")


async def test_get_answers_the_version_as_etag_and_mutations_answer_the_new_one(
    world: World, upgradable: uuid.UUID
) -> None:
    w, instance_id = world, upgradable
    async with http(w, w.admin) as c:
        v = await instance_version(c, instance_id)
        r = await c.post(f"/instances/{instance_id}/upgrade", json={"app_version": "2.0"}, headers=if_match(v))
        assert r.status_code == 200, r.text
        assert r.json()["desired_app_version"] == "2.0" and etag_version(r) == v + 1
        assert await instance_version(c, instance_id) == v + 1
        # the weak form and `*` are accepted; no If-Match at all is what the SDK and controllers send
        r = await c.post(
            f"/instances/{instance_id}/upgrade", json={"app_version": "2.1"}, headers=if_match(f'W/"{v + 1}"')
        )
        assert r.status_code == 200 and r.headers["ETag"] == f'"{v + 2}"', r.text
        r = await c.post(f"/instances/{instance_id}/stop", headers=if_match("*"))
        assert r.status_code == 200 and r.json()["status"] in ("stopping", "stopped"), r.text
        assert etag_version(r) > v + 2


async def test_stale_if_match_is_412_on_every_mutation_and_writes_nothing(world: World) -> None:
    w = world
    instance_id, _ = await deployed(w)
    user = w.user(w.admin)
    op = (await user.operations(instance_id))[0]
    await user.request_operation(instance_id, "add", allocation_id=await w.allocation())  # the instance moves on
    async with http(w, w.admin) as c:
        current = await instance_version(c, instance_id)
    assert current > 1
    await w.manifest("2.0", digest=DIGEST2)
    fresh_alloc = str(await w.allocation())
    instance_calls: list[tuple[str, dict[str, Any] | None]] = [
        (f"/instances/{instance_id}/upgrade", {"app_version": "2.0"}),
        (f"/instances/{instance_id}/rollback", None),
        (f"/instances/{instance_id}/stop", None),
        (f"/instances/{instance_id}/start", None),
        (f"/instances/{instance_id}/decommission", {"reason": "done"}),
        (f"/instances/{instance_id}/decommission/force", {"reason": "gone"}),
        (f"/instances/{instance_id}/operations", {"kind": "add", "allocation_id": fresh_alloc}),
    ]
    operation_calls = [
        (f"/operations/{op.operation_id}/{action}", {"reason": "stale"}) for action in ("retry", "cancel", "force-fail")
    ]
    async with http(w, w.admin) as c, controller_http(w) as ctl:
        await assert_all_stale(
            lambda: snapshot(w, instance_id),
            [
                *((path, post_with(c, path, body, current - 1)) for path, body in instance_calls),
                *((path, post_with(c, path, body, op.version + 1)) for path, body in operation_calls),
                (
                    "controller operation request",
                    post_with(
                        ctl,
                        f"/controller/instances/{instance_id}/operations",
                        {"kind": "add", "allocation_id": fresh_alloc},
                        current + 1,
                    ),
                ),
            ],
        )
    # the current version goes through
    async with http(w, w.admin) as c:
        r = await c.post(f"/instances/{instance_id}/decommission", json={"reason": "done"}, headers=if_match(current))
        assert r.status_code == 200 and r.json()["status"] in ("decommissioning", "decommissioned"), r.text
        assert etag_version(r) > current


async def test_malformed_if_match_is_422_and_writes_nothing(world: World) -> None:
    w = world
    instance_id, _ = await deployed(w)
    op = (await w.user(w.admin).operations(instance_id))[0]
    assert '"1", "2"' in MALFORMED_IF_MATCH  # a list of tags is not one version
    async with http(w, w.admin) as c:
        await assert_all_malformed_rejected(
            lambda: snapshot(w, instance_id),
            [
                ("stop", lambda value: c.post(f"/instances/{instance_id}/stop", headers=if_match(value))),
                (
                    "operation request",
                    lambda value: c.post(
                        f"/instances/{instance_id}/operations",
                        json={"kind": "add", "allocation_id": str(uuid.uuid4())},
                        headers=if_match(value),
                    ),
                ),
                (
                    "cancel",
                    lambda value: c.post(
                        f"/operations/{op.operation_id}/cancel", json={"reason": "x"}, headers=if_match(value)
                    ),
                ),
            ],
        )


async def test_operation_request_moves_the_instance_version_and_answers_the_operation_etag(world: World) -> None:
    w = world
    instance_id, _ = await deployed(w)
    async with http(w, w.admin) as c:
        v = await instance_version(c, instance_id)
        r = await c.post(
            f"/instances/{instance_id}/operations",
            json={"kind": "add", "allocation_id": str(await w.allocation())},
            headers=if_match(v),
        )
        assert r.status_code == 201, r.text
        assert etag_version(r) == 1
        assert await instance_version(c, instance_id) == v + 1
    updated = await w.rt.outbox("instance.updated", instance_id)
    assert updated and updated[-1]["data"]["version"] == v + 1  # the new version is published with the state


async def test_concurrent_operation_requests_on_one_version_exactly_one_wins(world: World) -> None:
    w = world
    instance_id, _ = await deployed(w)
    allocs = [str(await w.allocation()) for _ in range(2)]
    async with http(w, w.admin) as c:
        v = await instance_version(c, instance_id)
        ops_before = len(await w.user(w.admin).operations(instance_id))
        await exactly_one_wins(
            201,
            *(
                post_with(c, f"/instances/{instance_id}/operations", {"kind": "add", "allocation_id": a}, v)
                for a in allocs
            ),
        )
        assert await instance_version(c, instance_id) == v + 1
    assert len(await w.user(w.admin).operations(instance_id)) == ops_before + 1


async def test_concurrent_upgrades_on_one_version_exactly_one_wins(world: World, upgradable: uuid.UUID) -> None:
    w, instance_id = world, upgradable
    async with http(w, w.admin) as c:
        v = await instance_version(c, instance_id)
        winner, _ = await exactly_one_wins(
            200,
            *(post_with(c, f"/instances/{instance_id}/upgrade", {"app_version": to}, v) for to in ("2.0", "2.1")),
        )
        current = (await c.get(f"/instances/{instance_id}")).json()
    assert current["version"] == v + 1
    assert current["desired_app_version"] == winner.json()["desired_app_version"]
    upgrades = [e for e in await w.user(w.admin).timeline(instance_id) if e.kind == "instance.upgrade"]
    assert len(upgrades) == 1


async def test_operator_actions_check_the_operation_version(world: World) -> None:
    w = world
    instance_id, _ = await deployed(w)
    claim = await w.controller().claim(w.slug, lease_s=600, holder="stuck")
    assert claim is not None and claim.operation.version == 2  # pending (1) -> claimed (2)
    op_id = claim.operation.operation_id
    async with http(w, w.admin) as c:
        force_fail = f"/operations/{op_id}/force-fail"
        await assert_all_stale(
            lambda: snapshot(w, instance_id),
            [("force-fail", post_with(c, force_fail, {"reason": "host lost"}, 1))],
        )
        r = await c.post(force_fail, json={"reason": "host lost"}, headers=if_match(2))
        assert r.status_code == 200 and r.json()["status"] == "failed" and r.headers["ETag"] == '"3"', r.text
        r = await c.post(f"/operations/{op_id}/retry", json={"reason": "back"}, headers=if_match(r.headers["ETag"]))
        assert r.status_code == 200 and r.json()["status"] == "pending", r.text
        v = etag_version(r)
        # two operators act on the version they both read: one cancels, the other is told it moved on
        winner, _ = await exactly_one_wins(
            200,
            post_with(c, f"/operations/{op_id}/cancel", {"reason": "a"}, v),
            post_with(c, force_fail, {"reason": "b"}, v),
        )
    ops = {o.operation_id: o for o in await w.user(w.admin).operations(instance_id)}
    assert ops[op_id].status == winner.json()["status"] and ops[op_id].version == winner.json()["version"]
