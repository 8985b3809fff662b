"""Per-project container networks: allocations of one project reach each other, nothing else does.

    name      gpuaas-p-<project id hex>   (one podman bridge network per project on this machine)
    options   isolate=true (podman drops traffic between two isolated bridges) and no DNS helper
              (--disable-dns: the CNI dnsname plugin's per-network dnsmasq outlived `network rm` and its
              stale state broke the next network given the same bridge; names across a project come with
              the overlay, issue 27 item 1); containers use the host's resolvers
    contain   firewall.py: no new connection to the host itself, nothing internal (metadata, LAN, other
              podman networks, other projects), the outside through NAT (or the operator's allow-list)
    lifetime  created on demand by the first allocation of the project on this machine, removed with
              its last container (whichever agent removes it: several agents may share one podman), and
              with it everything the network had on the host: rules, bridge, address leases, DNS state
    start     prune(): containers left `Created` by a failed `podman run`, networks without a container,
              rules of networks that are gone, stale CNI state of removed networks

Creation, attaching a container and removal are serialised by a lock file per network under
/run/gpuaas-agent (shared by every agent of the machine), so an agent never removes a network another
agent is just attaching a container to. With the task's overlay the network is made on the project's subnet and
its bridge joins the project's VXLAN segment across hosts (overlay.py; `join_overlay`), and the segment's port goes
with the network; without it the network is host-local.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import re
import shlex
import shutil
import signal
import sys
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any, cast

from gpuaas.contracts.agent import OverlaySpec
from gpuaas.node_agent import overlay
from gpuaas.node_agent.firewall import EgressPolicy, Firewall, FirewallError
from gpuaas.node_agent.podman import NetworkInfo, Podman, PodmanError, json_objects

log = logging.getLogger("gpuaas.node_agent")
PREFIX = "gpuaas-p-"
LABEL = "gpuaas.project-network"
LOCK_DIR = Path(os.environ.get("GPUAAS_AGENT_NETWORK_LOCK_DIR", "/run/gpuaas-agent"))
# What podman's CNI backend keeps per network on the host (Debian 12's podman 4.3; docs/decisions.md).
CNI_CONFIG_DIR = Path("/etc/cni/net.d")  # <name>.conflist
CNI_LEASE_DIR = Path("/var/lib/cni/networks")  # host-local IPAM: one file per leased address; kept by `network rm`
DNSNAME_DIR = Path("/run/containers/cni/dnsname")  # dnsname plugin: dnsmasq.conf, pidfile, addnhosts
_UUID_HEX = re.compile(r"^[0-9a-f]{32}$")


class NetworkError(RuntimeError):
    pass


def network_name(project_id: str | None) -> str | None:
    """The project's network name, or None when the payload names no (valid) project."""
    key = str(project_id or "").replace("-", "").lower()
    return PREFIX + key if _UUID_HEX.match(key) else None


def _key(name: str) -> str:
    return name.removeprefix(PREFIX)


class ProjectNetworks:
    def __init__(self, podman: Podman, policy: EgressPolicy | None = None) -> None:
        self.podman = podman
        self.firewall = Firewall(LOCK_DIR, policy)

    @contextlib.asynccontextmanager
    async def locked(self, name: str) -> AsyncGenerator[None, None]:
        LOCK_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(LOCK_DIR / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    async def _inspect(self, name: str) -> NetworkInfo | None:
        rc, out, _ = await self.podman.run("network", "inspect", name, check=False)
        if rc != 0:
            return None
        data = json_objects(out)
        return cast("NetworkInfo", data[0]) if data else None  # checked objects; keys read with .get

    async def _names(self, *filters: str) -> list[str]:
        args = [x for f in filters for x in ("--filter", f)]
        _, out, _ = await self.podman.run("network", "ls", *args, "--format", "{{.Name}}")
        return out.split()

    async def ensure(self, name: str, segment: OverlaySpec | None = None) -> None:
        """Create the network (isolated bridge, no DNS helper) and contain it; call under `locked(name)`. With the
        project's overlay `segment`: on the segment's subnet (gateway: its first address) and MTU."""
        info = await self._inspect(name)
        subnet = str(segment.subnet) if segment else None
        if info is not None and not await self._users(name):
            stale = info.get("dns_enabled") or (subnet is not None and _subnets(info) != [subnet])
            if stale:  # made by an earlier agent with the dnsname helper, or on another subnet: made again
                await self._remove(name, info)
                info = None
        if info is None:
            await self._clear_state(name)  # whatever a killed agent left of an earlier network of this name
            try:
                create = ["network", "create", "--label", f"{LABEL}=1", "--disable-dns", "-o", "isolate=true"]
                if segment is not None:
                    seg = overlay.from_spec(segment)
                    create += ["--subnet", str(seg.subnet), "--gateway", str(seg.gateway)]
                    create += ["-o", f"mtu={overlay.member_mtu()}"]
                await self.podman.run(*create, name)
            except PodmanError as exc:
                if "already exists" not in str(exc):
                    raise NetworkError(f"network {name} could not be created: {exc}") from exc
            info = await self._inspect(name) or {}
        iface = info.get("network_interface")
        if not iface or (info.get("options") or {}).get("isolate") != "true":
            raise NetworkError(f"network {name} is not an isolated bridge ({info})")
        if subnet is not None and _subnets(info) != [subnet]:
            raise NetworkError(f"network {name} is on {_subnets(info)}, in use: not moved to the overlay's {subnet}")
        try:
            await self.firewall.attach(_key(name), str(iface))
        except FirewallError as exc:
            raise NetworkError(f"network {name} could not be contained: {exc}") from exc

    async def join_overlay(self, name: str, segment: OverlaySpec) -> int | None:
        """The network's bridge joins the project's segment (overlay.join) and every member of the project here
        gets the segment's names in its /etc/hosts; the number of members named, None without the network. Call
        under `locked(name)`."""
        info = await self._inspect(name)
        if info is None or not info.get("network_interface"):
            return None
        seg = overlay.from_spec(segment)
        try:
            await overlay.join(str(info.get("network_interface")), seg)
        except overlay.OverlayError as exc:
            raise NetworkError(f"network {name} could not join segment {seg.vni}: {exc}") from exc
        members = await self._users(name, "running")
        for member in members:
            hosts = ((await self.podman.inspect(member)) or {}).get("HostsPath")
            if hosts:
                await asyncio.to_thread(overlay.write_hosts, Path(hosts), seg.names)
        return len(members)

    async def _users(self, name: str, state: str | None = None) -> list[str]:
        filters = ["--filter", f"network={name}"] + (["--filter", f"status={state}"] if state else [])
        _, out, _ = await self.podman.run("ps", "-a", *filters, "--format", "{{.Names}}")
        return out.split()

    async def remove_if_unused(self, name: str) -> bool:
        """Remove the network when no container (of any agent) is attached; call under `locked(name)`."""
        info = await self._inspect(name)
        if info is None:
            return False
        for leftover in await self._users(name, "created"):  # a failed `podman run` (it holds an address)
            await self.podman.remove(leftover)
            log.warning("removed container %s left created (never started) on %s", leftover, name)
        if await self._users(name):
            return False
        await self._remove(name, info)
        log.info("project network %s removed (no allocation left on it)", name)
        return True

    async def _remove(self, name: str, info: NetworkInfo) -> None:
        """Rules first (they name the bridge, which podman hands to its next network), then the network. The
        bridge's overlay port goes before either (leaving the project's segment on this host)."""
        bridge = str(info.get("network_interface") or "")
        try:
            for vni, master in (await overlay.segments()).items():
                if bridge and master == bridge:
                    await overlay.leave(vni)
        except overlay.OverlayError as exc:
            raise NetworkError(f"network {name}: overlay port not removed: {exc}") from exc
        try:
            await self.firewall.detach(_key(name), then=lambda: self.podman.run("network", "rm", name, check=False))
        except FirewallError as exc:
            raise NetworkError(f"network {name}: containment rules not removed: {exc}") from exc
        await self._clear_state(name)
        iface = str(info.get("network_interface") or "")
        if iface and await self._inspect(name) is None and not await self._iface_in_use(iface):
            await _exec("ip", "link", "del", iface)  # podman removes the bridge; one left by a crash goes here
            await _clear_cni_rules({iface})

    async def _iface_in_use(self, iface: str) -> bool:
        """Whether a network has bridge `iface` now (podman reuses bridge names): one `network ls` that lists
        every network whole, not an inspect per network (this runs for each network a churn removes)."""
        _, out, _ = await self.podman.run("network", "ls", "--format", "json")
        return any(n.get("network_interface") == iface for n in json_objects(out))

    async def _clear_state(self, name: str) -> None:
        """The CNI state podman keeps after `network rm`: address leases and the dnsname helper (its dnsmasq
        is stopped by its pid file, then its directory goes)."""
        await asyncio.to_thread(_clear_cni_state, name)

    async def prune(self) -> list[str]:
        """On agent start: remove project networks nothing is attached to (a crash between the last
        container's removal and the network's; containers left Created by a failed run go first), then the
        rules and CNI state no network owns."""
        removed: list[str] = []
        for name in await self._names(f"label={LABEL}=1"):
            async with self.locked(name):
                if await self.remove_if_unused(name):
                    removed.append(name)
        await self.reconcile_host()
        return removed

    async def reconcile_host(self) -> dict[str, Any]:
        """Rules exactly for the project networks that exist; CNI state only for networks that exist."""
        names: list[str] = []

        async def live() -> dict[str, str]:  # read under the firewall's lock (see Firewall.detach)
            found: dict[str, str] = {}
            names.extend(await self._names())
            for name in names:
                iface = (
                    ((await self._inspect(name)) or {}).get("network_interface") if name.startswith(PREFIX) else None
                )
                if iface:
                    found[_key(name)] = str(iface)
            return found

        try:
            dropped = await self.firewall.sync(live)
        except FirewallError as exc:
            raise NetworkError(str(exc)) from exc
        if dropped:
            log.info("dropped containment rules of %d network(s) that no longer exist", len(dropped))
        try:
            left = await overlay.prune()  # overlay ports whose bridge went with a network a killed agent removed
        except overlay.OverlayError as exc:
            raise NetworkError(str(exc)) from exc
        if left:
            log.info("removed overlay ports without a bridge: %s", ", ".join(left))
        named = await _cni_rules(None)
        stale = {i for i in named if not await self._iface_in_use(i)}  # each checked just before: made meanwhile?
        stale_rules = await _clear_cni_rules(stale) if stale else 0
        cleared: list[str] = []
        for entry in await asyncio.to_thread(_state_entries):
            if entry not in names and await self._inspect(entry) is None:  # checked again: made meanwhile?
                await self._clear_state(entry)
                cleared.append(entry)
        return {"rules_dropped": sorted(dropped), "cni_rules_dropped": stale_rules, "state_cleared": cleared}

    async def leftovers(self, name: str, iface: str = "") -> list[str]:
        """What the host still holds of network `name` (empty once it is gone): for tests and operators. Given
        the bridge it had (`iface`), unless another network has it now: the bridge, the CNI rules naming it."""
        info = await self._inspect(name)
        found = [f"podman network {name}"] if info is not None else []
        for path in (CNI_CONFIG_DIR / f"{name}.conflist", CNI_LEASE_DIR / name, DNSNAME_DIR / name):
            if path.exists():
                found.append(str(path))
        found += [f"dnsmasq pid {pid}" for pid in _dnsmasq_pids(name)]
        rules = await self.firewall.rules()
        found += [
            f"rule (IPv{f}) {line}" for f, text in rules.items() for line in text.splitlines() if _key(name) in line
        ]
        if iface and not await self._iface_in_use(iface):
            found += [
                f"rule ({tool} -t {table}) {line}" for tool, table, line in (await _cni_rules({iface})).get(iface, [])
            ]
            if await _exec("ip", "link", "show", iface) == 0:
                found.append(f"bridge {iface}")
        return found

    async def address(self, container: str, name: str) -> str | None:
        info = await self.podman.inspect(container) or {}
        net = ((info.get("NetworkSettings") or {}).get("Networks") or {}).get(name) or {}
        return net.get("IPAddress") or None


def _subnets(info: NetworkInfo) -> list[str]:
    return [str(s.get("subnet")) for s in info.get("subnets") or []]


def _dnsmasq_pids(name: str) -> list[int]:
    """dnsmasq processes serving network `name` (the dnsname plugin names its conf file in the command)."""
    conf = str(DNSNAME_DIR / name / "dnsmasq.conf")
    pids: list[int] = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                if argv and argv[0].endswith(b"dnsmasq") and any(a.endswith(conf.encode()) for a in argv):
                    pids.append(int(entry))
    return pids


def _stop(pids: list[int], timeout_s: float = 3) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pids = [p for p in pids if Path(f"/proc/{p}").exists() and not _zombie(p)]
            if not pids:
                return
            time.sleep(0.05)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _clear_cni_state(name: str) -> None:
    if "/" in name or name in ("", ".", ".."):
        return
    _stop(_dnsmasq_pids(name))
    for path in (DNSNAME_DIR / name, CNI_LEASE_DIR / name):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)


def _state_entries() -> set[str]:
    """Networks with CNI state on the host; state of a network podman no longer has (removed by hand or by a
    killed agent) is stale: its dnsname conf names a bridge podman hands to the next network."""
    found: set[str] = set()
    for root in (DNSNAME_DIR, CNI_LEASE_DIR):
        with contextlib.suppress(OSError):
            found |= set(os.listdir(root))
    return found


_CNI_IFACE = re.compile(r"(?:^| )-[io] (cni-podman\d+)(?= |$)")


async def _cni_rules(ifaces: set[str] | None) -> dict[str, list[tuple[str, str, str]]]:
    """{bridge: [(tool, table, rule)]} of the rules podman's CNI plugins wrote naming a cni-podman bridge (all of
    them, or those of `ifaces`): its isolation stages, the dnsname plugin's INPUT accept for port 53."""
    found: dict[str, list[tuple[str, str, str]]] = {}
    for tool in ("iptables", "ip6tables"):
        if not shutil.which(tool):
            continue
        for table in ("filter", "nat"):
            proc = await asyncio.create_subprocess_exec(
                tool, "-w", "-t", table, "-S", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
            )
            out, _ = await proc.communicate()
            for line in out.decode().splitlines():
                if not line.startswith("-A ") or "GPUAAS-" in line:
                    continue
                for iface in set(_CNI_IFACE.findall(line)):
                    if ifaces is None or iface in ifaces:
                        found.setdefault(iface, []).append((tool, table, line))
    return found


async def _clear_cni_rules(ifaces: set[str]) -> int:
    """Delete the CNI plugins' rules naming these bridges (left behind when their network went; podman's
    shared chains, CNI-FORWARD and the rest, stay)."""
    dropped = 0
    for rules in (await _cni_rules(ifaces)).values():
        for tool, table, line in rules:
            if await _exec(tool, "-w", "-t", table, "-D", *shlex.split(line)[1:]) == 0:
                dropped += 1
    return dropped


async def _exec(*argv: str) -> int:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    return await proc.wait()


def main(argv: list[str] | None = None) -> int:
    """`python -m gpuaas.node_agent.project_network prune [containers.conf]`: remove the project networks no
    container is attached to (test stacks remove their agents' containers without the agents), with their
    rules and CNI state."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "prune":
        print(main.__doc__, file=sys.stderr)
        return 2
    removed = asyncio.run(ProjectNetworks(Podman(containers_conf=args[1] if len(args) > 1 else "")).prune())
    print(" ".join(removed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
