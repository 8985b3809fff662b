"""What each kind of reference resolves against (see `refs` for the rules): the lists a command reads to
turn a name or a short id into the id the API takes. A full id is taken as it is, without a lookup, so
everything that worked with ids before works the same way."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from gpuaas.cli.refs import Unresolved, is_uuid, resolve
from gpuaas.sdk import Client
from gpuaas.sdk.models import Instance, Membership

T = TypeVar("T")


async def my_projects(c: Client) -> list[dict[str, Any]]:
    """The projects the signed-in user is a member of (and, for tenant admins, their tenants' projects),
    each with its tenant's name (`tenant_name`)."""
    me = await c.me()
    tenants = {str(t["tenant_id"]): t for t in await c.tenants()}
    found: dict[str, dict[str, Any]] = {}
    for m in me.memberships:
        if m.project_id and str(m.project_id) not in found:
            found[str(m.project_id)] = (await c.project(m.project_id)).model_dump(mode="json")
        elif m.project_id is None and m.tenant_id and m.role == "tenant_admin":
            for p in await c.tenant_projects(m.tenant_id):
                found.setdefault(str(p.project_id), p.model_dump(mode="json"))
    for p in found.values():
        p["tenant_name"] = tenants.get(str(p["tenant_id"]), {}).get("name")
    return list(found.values())


async def project(c: Client, ref: str) -> str:
    if is_uuid(ref):
        return ref
    items = await my_projects(c)
    p = resolve(
        "project",
        ref,
        items,
        id_of=lambda p: p["project_id"],
        names=lambda p: (p["name"], f"{p.get('tenant_name')}/{p['name']}"),
    )
    return str(p["project_id"])


async def tenant(c: Client, ref: str) -> str:
    if is_uuid(ref):
        return ref
    items = await c.tenants()
    return str(
        resolve("tenant", ref, items, id_of=lambda t: t["tenant_id"], names=lambda t: (t["name"], t["slug"]))[
            "tenant_id"
        ]
    )


def _live_first(
    kind: str,
    ref: str,
    items: list[T],
    live: list[T],
    id_of: Callable[[T], object],
    names: Callable[[T], Iterable[object]],
) -> T:
    """A released/decommissioned thing keeps its name: a live namesake wins; the others are found only when no
    live one fits."""
    try:
        return resolve(kind, ref, live, id_of=id_of, names=names)
    except Unresolved as exc:
        if exc.code != "not_found":
            raise
        return resolve(kind, ref, items, id_of=id_of, names=names)


async def allocation(c: Client, project_id: str, ref: str) -> str:
    if is_uuid(ref):
        return ref
    items = await c.allocations(project_id, include_released=True)
    live = [a for a in items if a.status != "released"]
    a = _live_first("allocation", ref, items, live, lambda a: a.allocation_id, lambda a: (a.name,))
    return str(a.allocation_id)


async def instance(c: Client, project_id: str, ref: str) -> str:
    if is_uuid(ref):
        return ref
    items: list[Instance] = await c.instances(project_id=project_id)
    live = [i for i in items if i.status != "decommissioned"]
    return str(_live_first("instance", ref, items, live, lambda i: i.instance_id, lambda i: (i.name,)).instance_id)


async def member(c: Client, instance_id: str, ref: str) -> str:
    """An instance's member: its id (or prefix), or the allocation it runs on (id, prefix) when only one live
    member runs there."""
    if is_uuid(ref):
        members = await c.members(instance_id)
        on_alloc = [m for m in members if str(m.allocation_id) == ref and not m.tombstoned]
        return str(on_alloc[0].member_id) if len(on_alloc) == 1 else ref
    members = [m for m in await c.members(instance_id) if not m.tombstoned]
    return str(resolve("member", ref, members, id_of=lambda m: m.member_id, names=lambda m: ()).member_id)


async def volume(c: Client, project_id: str, ref: str) -> str:
    if is_uuid(ref):
        return ref
    items = [v for v in await c.volumes(project_id) if v.status != "deleted"]
    return str(resolve("volume", ref, items, id_of=lambda v: v.volume_id, names=lambda v: (v.name,)).volume_id)


async def ssh_key(c: Client, ref: str) -> str:
    if is_uuid(ref):
        return ref
    items = await c.ssh_keys()
    return str(resolve("SSH key", ref, items, id_of=lambda k: k.key_id, names=lambda k: (k.name, k.fingerprint)).key_id)


async def grant(c: Client, allocation_id: str, ref: str) -> str:
    if is_uuid(ref):
        return ref
    items = [g for g in await c.ssh_grants(allocation_id) if g.status == "active"]
    return str(resolve("grant", ref, items, id_of=lambda g: g.grant_id, names=lambda g: (g.fingerprint,)).grant_id)


async def user(c: Client, project_id: str, ref: str) -> str:
    """A member of the project: by email, display name, user id or its prefix."""
    if is_uuid(ref):
        return ref
    items: list[Membership] = await c.project_members(project_id)
    m = resolve(
        "project member",
        ref,
        items,
        id_of=lambda m: m.user_id,
        names=lambda m: (m.email or "", m.display_name or ""),
    )
    return str(m.user_id)
