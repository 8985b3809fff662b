"""A disjoint overlay pool per running stack on this machine (issue 27).

Every stack's agents build their projects' bridges and VXLAN devices in the same kernel: two stacks on the
default pool would both give their first project 10.208.0.0/24 and VNI 0x100000, and the second's bridge is
refused ("subnet already used on the host"). A stack therefore claims one of 16 slots with an exclusive
`flock` held while it runs (released by stop, or by the kernel when its process dies), and hands allocations
that slot's /16 and VNI range. The root remembers its slot: a restarted stack takes the same one when free, so
its projects' existing segments keep their subnets. Any other slot is skipped while a subnet of this machine
overlaps it (a podman network or an interface address): a stack killed without its stop leaves its agents'
project networks, with their containers, holding the slot's first subnets."""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any, cast

import psutil

SLOTS = 16
POOL = ipaddress.IPv4Network("10.208.0.0/12")  # the service's default pool, cut into 16 /16s
VNI_BASE = 0x100000  # the service's default; each slot gets 256 ids (one per /24 of its /16)
LOCK_DIR = Path(tempfile.gettempdir()) / "gpuaas-overlay-slots"


class NoFreeSlot(RuntimeError):
    pass


class OverlaySlot:
    def __init__(self, root: Path) -> None:
        self.remembered = root / "overlay-slot"
        self._fd: int | None = None
        self.slot: int | None = None

    def claim(self) -> int:
        """This stack's slot (the remembered one when free, else the lowest free), held until `release`."""
        if self.slot is not None:
            return self.slot
        LOCK_DIR.mkdir(mode=0o1777, exist_ok=True)
        try:
            previous = int(self.remembered.read_text())
        except (OSError, ValueError):
            previous = None
        order = [previous] if previous is not None and 0 <= previous < SLOTS else []
        in_use = subnets_in_use()
        for slot in [*order, *(s for s in range(SLOTS) if s != previous)]:
            if slot != previous and any(n.overlaps(slot_network(slot)) for n in in_use):
                continue
            fd = os.open(LOCK_DIR / f"slot-{slot}", os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._fd, self.slot = fd, slot
            self.remembered.parent.mkdir(parents=True, exist_ok=True)
            self.remembered.write_text(str(slot))
            return slot
        raise NoFreeSlot(
            f"no free slot of {SLOTS}: stacks run on this machine (locks in {LOCK_DIR}) or its networks use the "
            f"slots' subnets ({', '.join(str(n) for n in in_use if n.overlaps(POOL))})"
        )

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = self.slot = None

    def env(self) -> dict[str, str]:
        """The allocations service's settings for the claimed slot."""
        slot = self.claim()
        return {
            "GPUAAS_ALLOCATIONS_OVERLAY_POOL": str(slot_network(slot)),
            "GPUAAS_ALLOCATIONS_OVERLAY_VNI_BASE": str(VNI_BASE + (slot << 8)),
        }


def slot_network(slot: int) -> ipaddress.IPv4Network:
    return ipaddress.IPv4Network((int(POOL.network_address) + (slot << 16), 16))


# Where podman keeps its networks' definitions: CNI (the agents' backend here) and netavark.
NETWORK_CONFIGS = (Path("/etc/cni/net.d"), Path("/etc/containers/networks"))


def subnets_in_use() -> list[ipaddress.IPv4Network]:
    """The IPv4 subnets of this machine's podman networks (read from their definitions, as podman itself checks
    a new network against them) and of its interface addresses."""
    found: list[ipaddress.IPv4Network] = []
    for folder in NETWORK_CONFIGS:
        for path in sorted(folder.glob("*.conflist")) + sorted(folder.glob("*.json")):
            with contextlib.suppress(OSError, ValueError):
                for subnet in _subnet_values(json.loads(path.read_text())):
                    with contextlib.suppress(ValueError, TypeError):
                        found.append(ipaddress.IPv4Network(subnet, strict=False))
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family == socket.AF_INET and addr.netmask:
                with contextlib.suppress(ValueError):
                    found.append(ipaddress.IPv4Interface(f"{addr.address}/{addr.netmask}").network)
    return found


def _subnet_values(node: Any) -> list[Any]:
    """Every value under a `subnet` key, at any depth (CNI nests them in ranges, netavark in a list)."""
    if isinstance(node, dict):
        items = cast("dict[str, Any]", node)
        return [v for k, v in items.items() if k == "subnet"] + [x for v in items.values() for x in _subnet_values(v)]
    if isinstance(node, list):
        return [x for v in cast("list[Any]", node) for x in _subnet_values(v)]
    return []
