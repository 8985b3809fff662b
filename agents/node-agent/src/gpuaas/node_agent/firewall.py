"""Containment of project networks: what an allocation's packets may reach, for IPv4 and IPv6 alike.

Chains of our own in the filter table of iptables and ip6tables, hooked first in INPUT and FORWARD (ahead of
podman's CNI chains, which accept everything a container sends):

    GPUAAS-INPUT    per project network: `-i <bridge>` new connections to any address of the host itself
                    (its gateway, LAN and public addresses, its IPv6 link-local ones, the agent's ports) are
                    rejected; replies to connections the host opened (published workload ports) pass, and so
                    does IPv6 neighbour discovery (without it a probe of the host hangs instead of failing)
    GPUAAS-FORWARD  per project network: `-i <bridge> ! -o <bridge>` (leaving the project's segment) goes
                    through GPUAAS-EGRESS; traffic between members of the project stays on the bridge
    GPUAAS-EGRESS   shared by all project networks, rebuilt atomically by each ensure: replies pass; the
                    resolvers the containers use (port 53 only); then every internal destination is
                    REJECTed (private, shared, link-local incl. the metadata addresses 169.254.169.254 and
                    fd00:ec2::254, loopback, multicast, reserved; every prefix on a host interface: the
                    LAN/underlay and every other podman network); what is left is the outside, reached through
                    podman's NAT: all of it, or only the operator's allow-list (CIDR[:port[-port]])
    GPUAAS-REJECT   how: a TCP reset (refused at once), an ICMP error for the rest

Rules name their network in a comment (`gpuaas-net-<project hex>`) and their bridge by name; the set of
per-network rules is always written as a whole (iptables-restore --noflush, one commit per family), so a
crash never leaves half of a network's rules. Without any project network nothing of ours is left: the
hooks and chains are deleted. `sync()` (agent start) rewrites the rules from the networks podman has.
The project's overlay (overlay.py) is a port of its bridge: frames between members on two hosts stay on the
bridge, and whatever a remote member routes through this host leaves by `-i <bridge>` like a local member's; the
underlay side (VXLAN only from peer hosts) is overlay.py's `GPUAAS-VXLAN`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import json
import logging
import os
import re
import shlex
import shutil
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict, cast

log = logging.getLogger("gpuaas.node_agent")
CHAINS = ("GPUAAS-INPUT", "GPUAAS-FORWARD", "GPUAAS-REJECT", "GPUAAS-EGRESS")
HOOKS = (("INPUT", "GPUAAS-INPUT"), ("FORWARD", "GPUAAS-FORWARD"))
COMMENT = "gpuaas-net-"
LEGACY_COMMENT = "gpuaas-host-block-"  # the INPUT rules of agents before containment (dropped at start)
INTERNAL_V4 = (
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",  # carrier-grade NAT, also cloud-internal services
    "127.0.0.0/8",
    "169.254.0.0/16",  # link-local: the metadata service 169.254.169.254
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
    "224.0.0.0/4",
    "240.0.0.0/4",
)
INTERNAL_V6 = (
    "::/128",
    "::1/128",
    "::ffff:0:0/96",  # IPv4-mapped: would reach the IPv4 ranges above
    "64:ff9b::/96",  # NAT64 of IPv4 ranges
    "fc00::/7",  # unique local: the metadata service fd00:ec2::254
    "fe80::/10",
    "ff00::/8",
)
_IFACE = re.compile(r"^[A-Za-z0-9_.:-]{1,15}$")
_KEY = re.compile(r"^[0-9a-z]{1,40}$")


class FirewallError(RuntimeError):
    pass


@dataclass(frozen=True)
class Allowed:
    """One allow-list entry: a destination prefix and, optionally, a port range (TCP and UDP)."""

    network: ipaddress.IPv4Network | ipaddress.IPv6Network
    ports: tuple[int, int] | None = None

    @classmethod
    def parse(cls, text: str) -> Allowed:
        """`203.0.113.0/24`, `203.0.113.7:443`, `0.0.0.0/0:8000-8100`, `[2001:db8::/32]:443`."""
        text = text.strip()
        ports = None
        if text.startswith("["):
            prefix, _, rest = text[1:].partition("]")
            port_text = rest.removeprefix(":") if rest else ""
            if rest and not rest.startswith(":"):
                raise ValueError(f"allow-list entry {text!r}: expected [prefix]:port")
        elif text.count(":") == 1:
            prefix, port_text = text.split(":")
        else:
            prefix, port_text = text, ""
        if port_text:
            lo, _, hi = port_text.partition("-")
            ports = (int(lo), int(hi or lo))
            if not 1 <= ports[0] <= ports[1] <= 65535:
                raise ValueError(f"allow-list entry {text!r}: ports outside 1..65535")
        return cls(ipaddress.ip_network(prefix, strict=False), ports)


@dataclass(frozen=True)
class EgressPolicy:
    """What leaves a project network: `allow` None means every destination that is not internal."""

    allow: tuple[Allowed, ...] | None = None
    resolvers: tuple[str, ...] = ()

    @classmethod
    def build(cls, allow: Sequence[str] | None, resolvers: Sequence[str] | None) -> EgressPolicy:
        found = host_resolvers() if resolvers is None else list(resolvers)
        return cls(
            allow=None if allow is None else tuple(Allowed.parse(x) for x in allow),
            resolvers=tuple(str(ipaddress.ip_address(r)) for r in found),
        )


def host_resolvers(path: Path = Path("/etc/resolv.conf")) -> list[str]:
    """The host's nameservers, as podman copies them into a container's resolv.conf (loopback ones are
    skipped by podman too)."""
    out: list[str] = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver":
                with contextlib.suppress(ValueError):
                    addr = ipaddress.ip_address(parts[1].split("%")[0])
                    if not addr.is_loopback:
                        out.append(str(addr))
    return out


async def _exec(*argv: str, stdin: str | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate(stdin.encode() if stdin is not None else None)
    return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")


class _AddrInfo(TypedDict, total=False):
    local: str
    prefixlen: int


class _Link(TypedDict, total=False):
    """One interface of `ip -j addr show` (what is read of it)."""

    addr_info: list[_AddrInfo] | None


async def host_prefixes() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """Every prefix on a host interface: the LAN/underlay, other podman (and compose) bridges, test veths."""
    rc, out, _ = await _exec("ip", "-j", "addr", "show")
    links = cast("list[_Link]", json.loads(out or "[]") if rc == 0 else [])  # ip's JSON; keys read with .get
    prefixes: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for link in links:
        for a in link.get("addr_info") or []:
            local, prefixlen = a.get("local"), a.get("prefixlen")
            if local is None or prefixlen is None:
                continue
            with contextlib.suppress(ValueError):
                prefixes.append(ipaddress.ip_network(f"{local}/{prefixlen}", strict=False))
    return prefixes


class Firewall:
    """The containment rules of this machine's project networks (shared by every agent of the machine:
    a lock file serialises changes)."""

    def __init__(self, lock_dir: Path, policy: EgressPolicy | None = None) -> None:
        self.lock_dir = lock_dir
        self.policy = policy  # None: keep the egress chain as it is (a prune run without agent settings)
        self.tools = {4: shutil.which("iptables") or "", 6: shutil.which("ip6tables") or ""}

    def available(self) -> bool:
        return all(self.tools.values()) and all(shutil.which(f"{t}-restore") for t in self.tools.values())

    @contextlib.asynccontextmanager
    async def _locked(self) -> AsyncGenerator[None, None]:
        self.lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.lock_dir / "firewall.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # ------------------------------------------------------------------------------------ interface

    async def attach(self, key: str, iface: str) -> None:
        """Contain the network `key` (its bridge `iface`); another entry naming that bridge is stale."""
        _check(key, iface)
        async with self._locked():
            current = await self.networks()
            current = {k: i for k, i in current.items() if i != iface}
            current[key] = iface
            await self._write(current)

    async def detach(self, key: str, then: Callable[[], Awaitable[object]] | None = None) -> None:
        """Drop the network's rules, then (still holding the lock) `then`: the network's removal, so that a
        concurrent `sync` sees the network either with its rules or gone, never gone with its rules back."""
        async with self._locked():
            current = await self.networks()
            current.pop(key, None)
            await self._write(current)
            if then is not None:
                await then()

    async def sync(self, live: Callable[[], Awaitable[dict[str, str]]]) -> dict[str, str]:
        """Make the rules exactly those of `live()` ({key: bridge}, read under the lock); returns the entries
        dropped."""
        async with self._locked():
            nets = await live()
            for key, iface in nets.items():
                _check(key, iface)
            current = await self.networks()
            await self._write(dict(nets))
            await self._drop_legacy()
        return {k: i for k, i in current.items() if nets.get(k) != i}

    async def networks(self) -> dict[str, str]:
        """{key: bridge} of the networks the IPv4 rules contain now."""
        rc, out, _ = await _exec(self.tools[4] or "iptables", "-w", "-S", "GPUAAS-FORWARD")
        found: dict[str, str] = {}
        for line in out.splitlines() if rc == 0 else []:
            spec = shlex.split(line)
            if "--comment" in spec and "-i" in spec:
                comment = spec[spec.index("--comment") + 1]
                if comment.startswith(COMMENT):
                    found[comment.removeprefix(COMMENT)] = spec[spec.index("-i") + 1]
        return found

    async def rules(self) -> dict[int, str]:
        """Every rule of ours, per family (`iptables -S` lines naming our chains): what tests look for."""
        out: dict[int, str] = {}
        for family, tool in self.tools.items():
            _, text, _ = await _exec(tool, "-w", "-S")
            out[family] = "\n".join(line for line in text.splitlines() if "GPUAAS-" in line or COMMENT in line)
        return out

    # --------------------------------------------------------------------------------------- writing

    async def _write(self, nets: dict[str, str]) -> None:
        if not self.available():
            raise FirewallError("iptables/ip6tables (and their -restore) are needed to contain project networks")
        for family, tool in self.tools.items():
            if not nets:
                await self._remove_all(tool)
                continue
            lines = ["*filter", *(f":{chain} - [0:0]" for chain in CHAINS[:3])]
            # TCP gets a reset (refused at once; ICMP errors are rate-limited per source), the rest an ICMP error.
            lines += ["-A GPUAAS-REJECT -p tcp -j REJECT --reject-with tcp-reset", "-A GPUAAS-REJECT -j REJECT"]
            if family == 6:  # neighbour discovery with the host: without it a probe hangs instead of being refused
                for kind in ("neighbour-solicitation", "neighbour-advertisement"):
                    lines.append(f"-A GPUAAS-INPUT -p ipv6-icmp --icmpv6-type {kind} -j RETURN")
            egress = await self._egress_rules(family, tool)
            if egress is not None:
                lines.append(":GPUAAS-EGRESS - [0:0]")
            for key, iface in sorted(nets.items()):
                tag = f"-m comment --comment {COMMENT}{key}"
                lines.append(
                    f"-A GPUAAS-INPUT -i {iface} -m conntrack ! --ctstate ESTABLISHED,RELATED {tag} -j GPUAAS-REJECT"
                )
                lines.append(f"-A GPUAAS-FORWARD -i {iface} ! -o {iface} {tag} -j GPUAAS-EGRESS")
            lines += egress or []
            lines += await self._hook_fixes(tool)
            lines.append("COMMIT")
            rc, _, err = await _exec(f"{tool}-restore", "-w", "--noflush", stdin="\n".join(lines) + "\n")
            if rc != 0:
                raise FirewallError(f"{tool}-restore refused the containment rules: {err.strip()[-400:]}")

    async def _egress_rules(self, family: int, tool: str) -> list[str] | None:
        """The shared egress chain's rules, or None to keep the chain as it is (no policy, chain present)."""
        if self.policy is None and (await _exec(tool, "-w", "-n", "-L", "GPUAAS-EGRESS"))[0] == 0:
            return None
        policy = self.policy or EgressPolicy.build(None, None)
        version = 4 if family == 4 else 6
        out = ["-A GPUAAS-EGRESS -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN"]
        for r in policy.resolvers:
            if ipaddress.ip_address(r).version == version:
                out += [f"-A GPUAAS-EGRESS -d {r} -p {p} --dport 53 -j RETURN" for p in ("udp", "tcp")]
        internal = {ipaddress.ip_network(p) for p in (INTERNAL_V4 if family == 4 else INTERNAL_V6)}
        internal |= {p for p in await host_prefixes() if p.version == version}
        # Skip what a wider internal prefix covers already (fewer rules, same effect).
        kept = [p for p in internal if not any(o != p and _within(p, o) for o in internal)]
        out += [f"-A GPUAAS-EGRESS -d {p} -j GPUAAS-REJECT" for p in sorted(kept, key=str)]
        if policy.allow is None:
            return [*out, "-A GPUAAS-EGRESS -j RETURN"]
        for a in policy.allow:
            if a.network.version != version:
                continue
            if a.ports is None:
                out.append(f"-A GPUAAS-EGRESS -d {a.network} -j RETURN")
            else:
                ports = f"{a.ports[0]}:{a.ports[1]}" if a.ports[0] != a.ports[1] else str(a.ports[0])
                out += [f"-A GPUAAS-EGRESS -d {a.network} -p {p} --dport {ports} -j RETURN" for p in ("tcp", "udp")]
        return [*out, "-A GPUAAS-EGRESS -j GPUAAS-REJECT"]

    async def _hook_fixes(self, tool: str) -> list[str]:
        """Restore lines that put each hook first in its built-in chain (podman inserts its own jumps at the
        top when it sets a network up; ours must come before they accept the container's traffic)."""
        fixes: list[str] = []
        for builtin, chain in HOOKS:
            _, out, _ = await _exec(tool, "-w", "-S", builtin)
            rules = [line for line in out.splitlines() if line.startswith("-A ")]
            ours = [i for i, line in enumerate(rules) if line == f"-A {builtin} -j {chain}"]
            if ours == [0]:
                continue
            fixes += [f"-D {builtin} -j {chain}" for _ in ours]
            fixes.append(f"-I {builtin} 1 -j {chain}")
        return fixes

    async def _remove_all(self, tool: str) -> None:
        for builtin, chain in HOOKS:
            while (await _exec(tool, "-w", "-D", builtin, "-j", chain))[0] == 0:
                pass
        for chain in CHAINS:  # flush all first: a chain still referenced by another cannot be deleted
            await _exec(tool, "-w", "-F", chain)
        for chain in CHAINS:
            await _exec(tool, "-w", "-X", chain)

    async def _drop_legacy(self) -> None:
        """Host-block rules of earlier agents (INPUT, comment gpuaas-host-block-*): containment replaces them."""
        tool = self.tools[4]
        _, out, _ = await _exec(tool, "-w", "-S", "INPUT")
        for line in out.splitlines():
            spec = shlex.split(line)
            if spec[:2] == ["-A", "INPUT"] and any(s.startswith(LEGACY_COMMENT) for s in spec):
                await _exec(tool, "-w", "-D", *spec[1:])


def _within(
    inner: ipaddress.IPv4Network | ipaddress.IPv6Network, outer: ipaddress.IPv4Network | ipaddress.IPv6Network
) -> bool:
    if isinstance(inner, ipaddress.IPv4Network) and isinstance(outer, ipaddress.IPv4Network):
        return inner.subnet_of(outer)
    if isinstance(inner, ipaddress.IPv6Network) and isinstance(outer, ipaddress.IPv6Network):
        return inner.subnet_of(outer)
    return False  # different families


def _check(key: str, iface: str) -> None:
    if not _KEY.match(key) or not _IFACE.match(iface):
        raise FirewallError(f"refusing a rule for network {key!r} on interface {iface!r}")
