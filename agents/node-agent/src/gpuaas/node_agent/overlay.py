"""A project's overlay across hosts (issue 27 item 1): one VXLAN segment per project, a port of the project's
bridge on every host where the project has allocations.

    device    gpuaas-v<vni hex>: VXLAN id <vni>, local <this host's enrolled underlay address>, UDP 4789, no
              multicast group and no learning: every forwarding entry is static, from the control plane
    fdb       00:00:00:00:00:00 dst <peer> for each other host of the segment (broadcast and ARP copied to
              each peer), <member MAC> dst <its host> for each member on another host
    members   a member's MAC follows from its address (0a:58:<IPv4 bytes>, as Kubernetes' bridge plugins do), so
              the control plane's address plan is the whole forwarding table; addresses are the allocations
              service's (stable for an allocation's life), so no two hosts hand out the same one
    gateway   each host's bridge has the same gateway address (anycast, as EVPN's distributed gateway): a
              member leaves the segment through its own host's NAT and containment (firewall.py); ARP for or
              from the gateway never crosses the segment (ebtables), so each host's gateway stays its own
    underlay  GPUAAS-VXLAN, first in INPUT: VXLAN datagrams only from a host that is a peer of some segment
              here; anyone else on the LAN cannot inject frames into a project's segment
    names     `<name>.<project>` lines in each member's /etc/hosts, a marked block the agent rewrites when the
              members change (written in place: the file is bind-mounted into the member)

Another project's members are on another VNI and another bridge: no frame crosses between segments, and
routed traffic between two project bridges meets GPUAAS-FORWARD/EGRESS (firewall.py) and is rejected.
Everything here is rebuilt from the task's `Segment` and the kernel's state (no state file): `join` is
idempotent, `leave` removes the device and its rules, `prune` removes devices whose bridge is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict, cast

from gpuaas.contracts.agent import OverlaySpec

log = logging.getLogger("gpuaas.node_agent")
VXLAN_PORT = 4789
VXLAN_OVERHEAD = 50  # outer IPv4 + UDP + VXLAN + inner Ethernet: a member's MTU is the underlay's less this
PREFIX = "gpuaas-v"
GUARD = "GPUAAS-VXLAN"
ZERO_MAC = "00:00:00:00:00:00"
HOSTS_BEGIN = "# gpuaas overlay: begin (written by the node agent)"
HOSTS_END = "# gpuaas overlay: end"
_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,62}\.)*[A-Za-z0-9-]{1,63}$")
IPv4 = ipaddress.IPv4Address


class OverlayError(RuntimeError):
    pass


@dataclass(frozen=True)
class Peer:
    """Another host of the segment: its underlay address and the members it holds."""

    underlay: IPv4
    addresses: tuple[IPv4, ...] = ()


@dataclass(frozen=True)
class Segment:
    vni: int
    subnet: ipaddress.IPv4Network
    local: IPv4  # this host's underlay address
    peers: tuple[Peer, ...] = ()
    names: Mapping[str, IPv4] = field(default_factory=dict[str, IPv4])

    def __post_init__(self) -> None:
        if not 1 <= self.vni < 1 << 24:
            raise OverlayError(f"VNI {self.vni} outside 1..2^24-1")
        if self.subnet.num_addresses < 4:
            raise OverlayError(f"subnet {self.subnet} has no room for members")
        for name, address in self.names.items():
            if not _NAME.match(name) or address not in self.subnet:
                raise OverlayError(f"name {name!r} → {address} is not a member name in {self.subnet}")

    @property
    def gateway(self) -> IPv4:
        """The bridge's address on every host: the subnet's first."""
        return next(self.subnet.hosts())

    @property
    def device(self) -> str:
        return vxlan_name(self.vni)

    def fdb(self) -> set[tuple[str, str]]:
        """{(MAC, underlay)}: a flood entry per other host, a MAC entry per member on another host."""
        out: set[tuple[str, str]] = set()
        for peer in self.peers:
            if peer.underlay == self.local:
                continue
            out.add((ZERO_MAC, str(peer.underlay)))
            out |= {(member_mac(a), str(peer.underlay)) for a in peer.addresses}
        return out


def vxlan_name(vni: int) -> str:
    return f"{PREFIX}{vni:x}"  # at most 14 characters (IFNAMSIZ is 16 with the NUL)


def member_mac(address: IPv4 | str) -> str:
    """The MAC of the member with this address (locally administered, unicast)."""
    return "0a:58:" + ":".join(f"{b:02x}" for b in IPv4(str(address)).packed)


def member_mtu(underlay_mtu: int = 1500) -> int:
    return underlay_mtu - VXLAN_OVERHEAD


async def _run(*argv: str, check: bool = True, stdin: str | None = None) -> str:
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except FileNotFoundError as exc:  # iproute2, iptables and ebtables (Debian: the iptables package) are needed
        raise OverlayError(f"{argv[0]} is not installed: the project overlay needs it") from exc
    out, err = await proc.communicate(stdin.encode() if stdin is not None else None)
    if check and proc.returncode != 0:
        raise OverlayError(f"{' '.join(argv)}: {err.decode(errors='replace').strip()[-300:]}")
    return out.decode(errors="replace") if proc.returncode == 0 else ""


class _VxlanData(TypedDict, total=False):
    id: int
    local: str
    port: int


class _LinkInfo(TypedDict, total=False):
    info_kind: str
    info_data: _VxlanData


class _Link(TypedDict, total=False):
    ifname: str
    master: str
    linkinfo: _LinkInfo


class _Fdb(TypedDict, total=False):
    mac: str
    dst: str


async def _links() -> dict[str, _Link]:
    """Our VXLAN devices on this host, by name."""
    out = await _run("ip", "-j", "-d", "link", "show", "type", "vxlan", check=False)
    links = cast("list[_Link]", json.loads(out or "[]"))  # ip's JSON; keys read with .get
    return {n: link for link in links if (n := link.get("ifname", "")).startswith(PREFIX)}


async def _fdb(device: str) -> set[tuple[str, str]]:
    out = await _run("bridge", "-j", "fdb", "show", "dev", device, check=False)
    entries = cast("list[_Fdb]", json.loads(out or "[]"))
    return {(e.get("mac", ""), e.get("dst", "")) for e in entries if e.get("dst")}


async def join(bridge: str, seg: Segment) -> None:
    """Make `bridge` (the project's network on this host) a member of the segment: the VXLAN port, its
    forwarding entries, the gateway's ARP kept local, the underlay guard. Idempotent: also how the peers are
    brought up to date when members come and go."""
    device = seg.device
    link = (await _links()).get(device)
    data = (link or {}).get("linkinfo", {}).get("info_data", {})
    if link is not None and (data.get("id"), data.get("local"), data.get("port")) != (
        seg.vni,
        str(seg.local),
        VXLAN_PORT,
    ):
        await _run("ip", "link", "del", device)  # made for another underlay address: made again
        link = None
    if link is None:
        await _run(
            *("ip", "link", "add", device, "type", "vxlan", "id", str(seg.vni), "local", str(seg.local)),
            *("dstport", str(VXLAN_PORT), "nolearning"),
        )
    if (link or {}).get("master") != bridge:
        await _run("ip", "link", "set", device, "master", bridge)
    await _run("ip", "link", "set", device, "mtu", str(member_mtu()), "up")  # the members' MTU: no fragments
    want, have = seg.fdb(), await _fdb(device)
    for mac, dst in sorted(have - want):
        await _run("bridge", "fdb", "del", mac, "dev", device, "dst", dst, check=False)
    for mac, dst in sorted(want - have):  # append: several flood entries share the zero MAC
        await _run("bridge", "fdb", "append", mac, "dev", device, "dst", dst)
    await _gateway_guard(device, seg.gateway, add=True)
    await _underlay_guard()


async def leave(vni: int) -> None:
    """The segment's port goes (its forwarding entries with it), then its rules."""
    device = vxlan_name(vni)
    if device in await _links():
        await _run("ip", "link", "del", device)
    await _gateway_guard(device, None, add=False)
    await _underlay_guard()


async def prune() -> list[str]:
    """On agent start: VXLAN ports whose bridge is gone (its network was removed by a killed agent)."""
    removed = [name for name, link in (await _links()).items() if not link.get("master")]
    for name in removed:
        await leave(int(name.removeprefix(PREFIX), 16))
    if not removed:
        await _underlay_guard()
    return removed


async def segments() -> dict[int, str]:
    """{VNI: bridge} of the segments this host is in (for operators and tests)."""
    return {int(n.removeprefix(PREFIX), 16): link.get("master", "") for n, link in (await _links()).items()}


# ----------------------------------------------------------------------------------------------- rules


def _arp_rules(device: str, gateway: IPv4) -> list[list[str]]:
    """ARP about the gateway neither leaves nor enters through the segment's port (ebtables `-i/-o`: the port)."""
    return [
        ["OUTPUT", "-o", device, "-p", "ARP", "--arp-ip-src", str(gateway), "-j", "DROP"],
        ["FORWARD", "-o", device, "-p", "ARP", "--arp-ip-dst", str(gateway), "-j", "DROP"],
        ["INPUT", "-i", device, "-p", "ARP", "--arp-ip-dst", str(gateway), "-j", "DROP"],
        ["INPUT", "-i", device, "-p", "ARP", "--arp-ip-src", str(gateway), "-j", "DROP"],
    ]


async def _gateway_guard(device: str, gateway: IPv4 | None, add: bool) -> None:
    chain = ""
    for line in (await _run("ebtables", "-L", check=False)).splitlines():  # every rule naming the port
        if line.startswith("Bridge chain: "):
            chain = line.removeprefix("Bridge chain: ").split(",")[0]
        elif line.startswith("-") and device in line.split() and chain:
            await _run("ebtables", "-D", chain, *line.split(), check=False)
    if add and gateway is not None:
        for rule in _arp_rules(device, gateway):
            await _run("ebtables", "-A", *rule)


async def _underlay_guard() -> None:
    """GPUAAS-VXLAN: VXLAN datagrams from the segments' peers pass, every other one is dropped; the chain and
    its hook exist only while this host is in a segment. Written as a whole (one restore per family)."""
    peers: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    for name in await _links():
        peers |= {ipaddress.ip_address(dst) for _, dst in await _fdb(name)}
    for family, tool in ((4, "iptables"), (6, "ip6tables")):
        hooked = "-A INPUT -j " + GUARD in (await _run(tool, "-w", "-S", "INPUT", check=False)).splitlines()
        if not await _links():
            if hooked:
                await _run(tool, "-w", "-D", "INPUT", "-j", GUARD, check=False)
            await _run(tool, "-w", "-F", GUARD, check=False)
            await _run(tool, "-w", "-X", GUARD, check=False)
            continue
        lines = ["*filter", f":{GUARD} - [0:0]"]
        lines += [
            f"-A {GUARD} -s {p} -p udp --dport {VXLAN_PORT} -j RETURN"
            for p in sorted(peers, key=str)
            if p.version == family
        ]
        lines.append(f"-A {GUARD} -p udp --dport {VXLAN_PORT} -j DROP")
        if not hooked:
            lines.append(f"-I INPUT 1 -j {GUARD}")
        await _run(f"{tool}-restore", "-w", "--noflush", stdin="\n".join([*lines, "COMMIT"]) + "\n")


# ----------------------------------------------------------------------------------------------- names


def hosts_text(current: str, names: Mapping[str, IPv4]) -> str:
    """`current` (a hosts file) with our block holding exactly `names`; the rest of the file is kept."""
    kept: list[str] = []
    inside = False
    for line in current.splitlines():
        if line == HOSTS_BEGIN:
            inside = True
        elif line == HOSTS_END:
            inside = False
        elif not inside:
            kept.append(line)
    block = [f"{address}\t{name}" for name, address in sorted(names.items())]
    return "\n".join([*kept, HOSTS_BEGIN, *block, HOSTS_END]) + "\n"


def write_hosts(path: Path, names: Mapping[str, IPv4]) -> None:
    """Rewrite the member's hosts file in place (it is bind-mounted into the member: a new file would not be
    seen there); never through a symlink."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "r+") as f:
        text = hosts_text(f.read(), names)
        f.seek(0)
        f.write(text)
        f.truncate()


def resolve(hosts: str, name: str) -> list[str]:
    """Addresses a hosts file gives `name` (what the tests compare with getent)."""
    out: list[str] = []
    for line in hosts.splitlines():
        parts = line.split("#", 1)[0].split()
        if len(parts) >= 2 and name in parts[1:]:
            out.append(parts[0])
    return out


def from_spec(spec: OverlaySpec) -> Segment:
    """The task's overlay spec as this module's Segment."""
    peers = tuple(Peer(p.underlay, tuple(p.addresses)) for p in spec.peers)
    return Segment(vni=spec.vni, subnet=spec.subnet, local=spec.underlay, peers=peers, names=dict(spec.names))


def segment(
    vni: int,
    subnet: str,
    local: str,
    peers: Iterable[tuple[str, Iterable[str]]] = (),
    names: Mapping[str, str] | None = None,
) -> Segment:
    """A Segment from plain values (the task's overlay spec, the tests)."""
    with contextlib.suppress(ValueError):
        return Segment(
            vni=vni,
            subnet=ipaddress.IPv4Network(subnet),
            local=IPv4(local),
            peers=tuple(Peer(IPv4(u), tuple(IPv4(a) for a in addrs)) for u, addrs in peers),
            names={n: IPv4(a) for n, a in (names or {}).items()},
        )
    raise OverlayError(f"overlay spec refused: vni={vni} subnet={subnet} local={local}")
