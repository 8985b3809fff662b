"""Allocation-to-allocation network through the stack: two allocations of one project on a container host
reach each other at the `network.address` the allocation view gives (the address app controllers use);
another tenant's allocation on the same host neither reaches them nor is reached; none of them reaches
the host (the agent's SSH port through its gateway, the host's services); the outside stays reachable; the
project's network goes with its last allocation."""

from __future__ import annotations

import socket
import subprocess

import pytest

from .harness import Agent, Tenant, out

pytestmark = pytest.mark.e2e
PORT = 18081


def probe(address: str, port: int) -> str:
    return f"timeout 3 bash -c 'echo > /dev/tcp/{address}/{port}' 2>/dev/null && echo open || echo closed"


LISTEN = (
    f'nohup python3 -c \'import socket; s = socket.socket(); s.bind(("", {PORT})); s.listen(); '
    "[s.accept() for _ in iter(int, 1)]' >/dev/null 2>&1 & sleep 0.5; echo started"
)


def networks() -> set[str]:
    cmd = ["podman", "network", "ls", "--format", "{{.Name}}"]
    return set(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split())


def outside_reachable_from_here() -> bool:
    try:
        socket.create_connection(("deb.debian.org", 80), 3).close()
        return True
    except OSError:
        return False


async def test_project_members_reach_each_other_other_tenants_and_the_host_do_not(
    host: Agent, tenants: tuple[Tenant, Tenant]
) -> None:
    ta, tb = tenants
    body = {"gpu_model": "H100-80GB", "gpu_count": 1, "host_class": host.host_class}
    a1 = await ta.active(**body, name="net-a1")
    a2 = await ta.active(**body, name="net-a2")
    b1 = await tb.active(**body, name="net-b1")
    assert a1["host_id"] == a2["host_id"] == b1["host_id"] == host.host_id
    n1, n2, nb = a1["network"], a2["network"], b1["network"]
    assert n1 and n2 and nb, (n1, n2, nb)
    assert n1["name"] == n2["name"] != nb["name"], (n1, n2, nb)
    assert len({n1["address"], n2["address"], nb["address"]}) == 3 and n1["scope"] == "project"  # overlay (issue 27)
    assert (await out(a1, ta.key, "hostname")).strip() == n1["hostname"]

    for alloc, t in ((a1, ta), (a2, ta), (b1, tb)):
        assert (await out(alloc, t.key, LISTEN)).strip() == "started"
    assert (await out(a2, ta.key, probe(n1["address"], PORT))).strip() == "open"  # same project
    assert (await out(a1, ta.key, probe(n2["address"], PORT))).strip() == "open"
    assert (await out(b1, tb.key, probe(n1["address"], PORT))).strip() == "closed"  # another tenant
    assert (await out(a1, ta.key, probe(nb["address"], PORT))).strip() == "closed"

    # The host: the agent's SSH port (this machine) through the allocation's gateway, and loopback.
    gateway = (await out(a1, ta.key, "ip route | awk '/^default/ {print $3}'")).strip()
    assert gateway, "the allocation has no default route"
    ssh_port = int(a1["ssh_endpoint"]["port"])
    for address in (gateway, "127.0.0.1"):
        assert (await out(a1, ta.key, probe(address, ssh_port))).strip() == "closed", address
    if outside_reachable_from_here():
        assert (await out(a1, ta.key, probe("deb.debian.org", 80))).strip() == "open"

    for alloc, t in ((a1, ta), (a2, ta), (b1, tb)):
        await t.release(alloc["allocation_id"])
    assert not {n1["name"], nb["name"]} & networks()
