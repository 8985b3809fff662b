"""A project's overlay across hosts (issue 27 item 1): the address plan the agents build the segment from.

    segment   one per project with live allocations on container hosts: an index, the lowest not held by another
              live project; VNI = the pool's VNI base + index, subnet = the index-th /24 of the pool (default
              10.208.0.0/12; gateway: its first address, the project bridge's on every host)
    address   per allocation, the lowest free in its project's subnet; kept in the allocation's `network`
              (`overlay`), so restart and resize keep it, and freed when the allocation is released or failed
    peers     the hosts of the project's live members (their ENROLLED address: the underlay), each with its members
    names     `<allocation id>.<domain>` for every member, `<allocation name>.<domain>` when the name is unique
              in the project (as a DNS label); domain = `p-<project id hex, 12>`

Picks are serialised by one transaction-scoped advisory lock, so two allocations never get the same index or
address. No migration: the assignment lives in the allocation's `network` JSON. The provision/restart task carries
the allocation's spec; the heartbeat's answer carries each of a host's segments as they are now, which is how the
other hosts learn of members coming and going."""

from __future__ import annotations

import ipaddress
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations.models import allocations, hosts
from gpuaas.contracts.agent import OverlaySpec
from gpuaas.contracts.enums import AllocationStatus

DEFAULT_POOL = ipaddress.IPv4Network("10.208.0.0/12")  # not 10.128/9: the default VPC of a large cloud
LOCK_KEY = 0x67707561_6F766C  # pg_advisory_xact_lock: "gpua" "ovl"
ENDED = (AllocationStatus.released, AllocationStatus.failed)


class OverlayExhausted(RuntimeError):
    pass


@dataclass(frozen=True)
class OverlayPool:
    """The addresses and VXLAN ids the segments are cut from: one /24 and one VNI per segment. A deployment's
    constant (settings `overlay_pool`, `overlay_vni_base`); two control planes whose agents share a machine need
    disjoint pools, or the second's project bridge is refused ("subnet already used") and its VXLAN ids collide."""

    network: ipaddress.IPv4Network = DEFAULT_POOL
    vni_base: int = 0x100000

    def __post_init__(self) -> None:
        if self.network.prefixlen > 24:
            raise ValueError(f"the overlay pool {self.network} must hold at least one /24")
        if not self.vni_base >= 1 or self.vni_base + self.segments >= 1 << 24:
            raise ValueError(f"VNIs {self.vni_base}..+{self.segments} must lie in 1..2^24-1")

    @classmethod
    def parse(cls, network: str, vni_base: int) -> OverlayPool:
        return cls(ipaddress.IPv4Network(network), vni_base)

    @property
    def segments(self) -> int:
        """/24s in the pool (the default: 4096 projects at once, 253 members each)."""
        return 1 << (24 - self.network.prefixlen)

    def subnet_of(self, index: int) -> ipaddress.IPv4Network:
        if not 0 <= index < self.segments:
            raise OverlayExhausted(f"segment index {index} outside the pool {self.network}")
        return ipaddress.IPv4Network((int(self.network.network_address) + (index << 8), 24))

    def first_free_index(self, used: set[int]) -> int:
        index = next((i for i in range(self.segments) if i not in used), None)
        if index is None:
            raise OverlayExhausted(f"every segment of {self.network} is in use")
        return index


_pool = OverlayPool()


def configure(pool: OverlayPool) -> None:
    """Set at startup from the settings (a deployment constant, like the lock key; not per request)."""
    global _pool
    _pool = pool


def pool() -> OverlayPool:
    return _pool


def first_free_address(subnet: ipaddress.IPv4Network, used: set[str]) -> ipaddress.IPv4Address:
    """The lowest address of `subnet` that is neither the gateway (its first) nor held by a member."""
    for address in list(subnet.hosts())[1:]:
        if str(address) not in used:
            return address
    raise OverlayExhausted(f"no free address left in {subnet}")


def domain_of(project_id: uuid.UUID) -> str:
    return f"p-{project_id.hex[:12]}"


def label(text: str) -> str:
    """`text` as a DNS label (lower case, letters, digits, dashes; at most 63), '' when nothing is left."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", text.lower())).strip("-")[:63].strip("-")


def names_of(project_id: uuid.UUID, members: Sequence[tuple[uuid.UUID, str, str]]) -> dict[str, str]:
    """{name: address} for members [(allocation id, allocation name, address)]."""
    domain = domain_of(project_id)
    out = {f"{a}.{domain}": address for a, _, address in members}  # (UUIDv7: a prefix would not be unique)
    chosen = [label(name) for _, name, _ in members]
    for (_, _, address), name in zip(members, chosen, strict=True):
        if name and chosen.count(name) == 1 and f"{name}.{domain}" not in out:
            out[f"{name}.{domain}"] = address
    return out


def _underlay(host: Any) -> ipaddress.IPv4Address | None:
    """A host's enrolled address, if it is an IPv4 literal (the segment runs over it)."""
    try:
        return ipaddress.IPv4Address(str(host.ssh_host or ""))
    except ValueError:
        return None


def _live() -> Any:
    return allocations.c.network.has_key("overlay") & allocations.c.status.notin_(ENDED)


async def _members(session: AsyncSession, project_id: uuid.UUID) -> list[Any]:
    q = select(allocations.c.allocation_id, allocations.c.name, allocations.c.host_id, allocations.c.network).where(
        allocations.c.project_id == project_id, _live()
    )
    return list((await session.execute(q)).all())


async def _spec(
    session: AsyncSession, project_id: uuid.UUID, host: Any, address: str | None, members: list[Any]
) -> OverlaySpec | None:
    """The project's segment as `host` sees it, with `members` [(allocation_id, name, host_id, network)]."""
    local = _underlay(host)
    if local is None or not members:
        return None
    first = members[0].network["overlay"]
    host_ids = {m.host_id for m in members}
    rows = (await session.execute(select(hosts).where(hosts.c.host_id.in_(host_ids)))).all()
    underlay = {h.host_id: _underlay(h) for h in rows}
    peers: dict[ipaddress.IPv4Address, list[str]] = {}
    for m in members:
        if (u := underlay.get(m.host_id)) is not None:
            peers.setdefault(u, []).append(m.network["overlay"]["address"])
    return OverlaySpec.model_validate(
        {
            "project_id": project_id,
            "vni": first["vni"],
            "subnet": first["subnet"],
            "address": address,
            "underlay": local,
            "peers": [{"underlay": u, "addresses": sorted(a)} for u, a in sorted(peers.items())],
            "names": names_of(
                project_id, [(m.allocation_id, m.name, m.network["overlay"]["address"]) for m in members]
            ),
        }
    )


async def overlay_for(session: AsyncSession, row: Any) -> OverlaySpec | None:
    """The allocation's place on its project's segment, assigned at its first provision and kept after (stored
    in its `network`); None on a host that runs no container driver or has no IPv4 enrolled address."""
    host = (await session.execute(select(hosts).where(hosts.c.host_id == row.host_id))).first()
    if host is None or host.driver != "container" or _underlay(host) is None:
        return None
    await session.execute(select(func.pg_advisory_xact_lock(LOCK_KEY)))
    members = await _members(session, row.project_id)
    mine = next((m for m in members if m.allocation_id == row.allocation_id), None)
    if mine is None:
        others = [m for m in members if m.allocation_id != row.allocation_id]
        if others:
            index = int(others[0].network["overlay"]["index"])
        else:
            q = select(allocations.c.network["overlay"]["index"].astext).where(_live()).distinct()
            index = _pool.first_free_index({int(i) for (i,) in (await session.execute(q)).all() if i is not None})
        subnet = _pool.subnet_of(index)
        address = first_free_address(subnet, {m.network["overlay"]["address"] for m in others})
        assigned = {"index": index, "vni": _pool.vni_base + index, "subnet": str(subnet), "address": str(address)}
        network = {
            "hostname": None,
            **(row.network or {}),
            "name": f"gpuaas-p-{row.project_id.hex}",  # the project network on every host (project_network.py)
            "address": str(address),
            "scope": "project",
            "overlay": assigned,
        }
        await session.execute(
            update(allocations).where(allocations.c.allocation_id == row.allocation_id).values(network=network)
        )
        members = await _members(session, row.project_id)
        mine = next(m for m in members if m.allocation_id == row.allocation_id)
    return await _spec(session, row.project_id, host, mine.network["overlay"]["address"], members)


async def segments_of_host(session: AsyncSession, host_id: uuid.UUID) -> list[OverlaySpec]:
    """Every project segment with a live member on the host, as it is now (the heartbeat's answer)."""
    host = (await session.execute(select(hosts).where(hosts.c.host_id == host_id))).first()
    if host is None or host.driver != "container":
        return []
    q = select(allocations.c.project_id).where(allocations.c.host_id == host_id, _live()).distinct()
    out: list[OverlaySpec] = []
    for (project_id,) in (await session.execute(q)).all():
        spec = await _spec(session, project_id, host, None, await _members(session, project_id))
        if spec is not None:
            out.append(spec)
    return out
