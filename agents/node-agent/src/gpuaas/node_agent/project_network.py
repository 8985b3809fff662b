"""Per-project container networks: allocations of one project reach each other, nothing else does.

    name      gpuaas-p-<project id hex>   (one podman bridge network per project on this machine)
    options   isolate=true: podman's firewall drops traffic between two isolated bridges, so another
              project's (or tenant's) allocations cannot reach these; outbound is NATed as usual
    host      an iptables INPUT rule rejects every connection the bridge opens to the host itself (its
              gateway address, its public addresses, 127.0.0.1 should a container route it there): the
              agent's ports and every host service stay out of reach; replies to connections the host
              opened (published workload ports) pass
    lifetime  created on demand by the first allocation of the project on this machine, removed with
              its last container (whichever agent removes it: several agents may share one podman)

Creation, attaching a container and removal are serialised by a lock file per network under
/run/gpuaas-agent (shared by every agent of the machine), so an agent never removes a network another
agent is just attaching a container to. The network is host-local: allocations of one project on two
different machines are not connected (docs/operations.md, "Known limits").
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import re
import shlex
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from gpuaas.node_agent.podman import Podman, PodmanError

log = logging.getLogger("gpuaas.node_agent")
PREFIX = "gpuaas-p-"
LABEL = "gpuaas.project-network"
LOCK_DIR = Path(os.environ.get("GPUAAS_AGENT_NETWORK_LOCK_DIR", "/run/gpuaas-agent"))
_UUID_HEX = re.compile(r"^[0-9a-f]{32}$")


class NetworkError(RuntimeError):
    pass


def network_name(project_id: str | None) -> str | None:
    """The project's network name, or None when the payload names no (valid) project."""
    key = str(project_id or "").replace("-", "").lower()
    return PREFIX + key if _UUID_HEX.match(key) else None


def _comment(name: str) -> str:
    return f"gpuaas-host-block-{name.removeprefix(PREFIX)[:12]}"


class ProjectNetworks:
    def __init__(self, podman: Podman, iptables: str = "iptables") -> None:
        self.podman = podman
        self.iptables = shutil.which(iptables) or ""

    @contextlib.asynccontextmanager
    async def locked(self, name: str) -> AsyncIterator[None]:
        LOCK_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(LOCK_DIR / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    async def _inspect(self, name: str) -> dict[str, Any] | None:
        rc, out, _ = await self.podman.run("network", "inspect", name, check=False)
        if rc != 0:
            return None
        data = json.loads(out or "[]")
        return data[0] if data else None

    async def _host_block(self, iface: str, name: str, add: bool) -> None:
        if not self.iptables:
            raise NetworkError("iptables not found: a project network would let allocations reach the host")
        # Replies to connections the host opened (a published workload port, health checks) still pass.
        rule = ["INPUT", "-i", iface, "-m", "conntrack", "!", "--ctstate", "ESTABLISHED,RELATED"]
        # REJECT, not DROP: podman lists the bridge's gateway as the first nameserver in the container's
        # resolv.conf; a dropped query would stall every lookup for the resolver's timeout (5 s) before the
        # host's own nameserver is tried, a rejected one moves on at once.
        rule += ["-m", "comment", "--comment", _comment(name), "-j", "REJECT"]
        exists = await _run(self.iptables, "-w", "-C", *rule) == 0
        if add and not exists:
            if await _run(self.iptables, "-w", "-I", *rule) != 0:
                raise NetworkError(f"iptables could not block the host from {iface}")
        elif not add:
            while exists:  # duplicates from a crash between check and insert
                await _run(self.iptables, "-w", "-D", *rule)
                exists = await _run(self.iptables, "-w", "-C", *rule) == 0

    async def ensure(self, name: str) -> None:
        """Create the network (isolated bridge) and its host block; call under `locked(name)`."""
        info = await self._inspect(name)
        if info is None:
            try:
                await self.podman.run("network", "create", "--label", f"{LABEL}=1", "-o", "isolate=true", name)
            except PodmanError as exc:
                if "already exists" not in str(exc):
                    raise NetworkError(f"network {name} could not be created: {exc}") from exc
            info = await self._inspect(name) or {}
        iface = info.get("network_interface")
        if not iface or (info.get("options") or {}).get("isolate") != "true":
            raise NetworkError(f"network {name} is not an isolated bridge ({info})")
        await self._host_block(iface, name, add=True)

    async def remove_if_unused(self, name: str) -> bool:
        """Remove the network when no container (of any agent) is attached; call under `locked(name)`."""
        info = await self._inspect(name)
        if info is None:
            return False
        _, out, _ = await self.podman.run("ps", "-a", "--filter", f"network={name}", "--format", "{{.ID}}")
        if out.strip():
            return False
        await self.podman.run("network", "rm", name, check=False)
        if info.get("network_interface"):
            await self._host_block(str(info["network_interface"]), name, add=False)
        log.info("project network %s removed (no allocation left on it)", name)
        return True

    async def prune(self) -> list[str]:
        """On agent start: remove project networks nothing is attached to (a crash between the last
        container's removal and the network's), then the host blocks no project network owns."""
        _, out, _ = await self.podman.run("network", "ls", "--filter", f"label={LABEL}=1", "--format", "{{.Name}}")
        removed = []
        for name in out.split():
            async with self.locked(name):
                if await self.remove_if_unused(name):
                    removed.append(name)
        await self.drop_orphan_blocks()
        return removed

    async def drop_orphan_blocks(self) -> int:
        """Delete host-block rules whose network is gone (removed by hand, or by a killed agent between
        `network rm` and the rule's deletion). The rules match by interface name, which podman hands to
        the next network it creates: an orphan would cut that network (a compose deployment's DNS on its
        gateway, say) off from the host."""
        if not self.iptables:
            return 0
        _, out, _ = await self.podman.run("network", "ls", "--filter", f"label={LABEL}=1", "--format", "{{.Name}}")
        owned = set()
        for name in out.split():
            info = await self._inspect(name) or {}
            owned.add((str(info.get("network_interface")), _comment(name)))
        proc = await asyncio.create_subprocess_exec(
            self.iptables, "-w", "-S", "INPUT", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
        )
        listing, _ = await proc.communicate()
        dropped = 0
        for line in listing.decode().splitlines():
            spec = shlex.split(line)
            if spec[:2] != ["-A", "INPUT"] or "--comment" not in spec or "-i" not in spec:
                continue
            comment, iface = spec[spec.index("--comment") + 1], spec[spec.index("-i") + 1]
            orphaned = comment.startswith("gpuaas-host-block-") and (iface, comment) not in owned
            if orphaned and await _run(self.iptables, "-w", "-D", *spec[1:]) == 0:
                dropped += 1
        if dropped:
            log.info("dropped %d host-block rule(s) of project networks that no longer exist", dropped)
        return dropped

    async def address(self, container: str, name: str) -> str | None:
        info = await self.podman.inspect(container) or {}
        net = ((info.get("NetworkSettings") or {}).get("Networks") or {}).get(name) or {}
        return net.get("IPAddress") or None


async def _run(*argv: str) -> int:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    if proc.returncode and b"does a matching rule exist" not in err and b"Bad rule" not in err:
        log.debug("%s: rc %s %s", " ".join(argv[:3]), proc.returncode, err.decode(errors="replace").strip())
    return proc.returncode or 0


def main(argv: list[str] | None = None) -> int:
    """`python -m gpuaas.node_agent.project_network prune [containers.conf]`: remove the project networks no
    container is attached to (test stacks remove their agents' containers without the agents)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "prune":
        print(main.__doc__, file=sys.stderr)
        return 2
    removed = asyncio.run(ProjectNetworks(Podman(containers_conf=args[1] if len(args) > 1 else "")).prune())
    print(" ".join(removed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
