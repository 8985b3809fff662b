"""Container driver, project networks: allocations of one project reach each other (also from two
agents sharing this machine's podman), another project's allocation does not reach them, none reaches
the host; the network goes with its last allocation."""

from __future__ import annotations

import socket
import subprocess
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_harness import (
    CONTAINERS_CONF,
    Host,
    agent_settings,
    containers_of,
    needs_podman,
    podman,
    start_host,
    stop_host,
)

from gpuaas.node_agent.podman import Podman
from gpuaas.node_agent.project_network import ProjectNetworks, network_name

pytestmark = needs_podman
PORT = 18080  # what the allocations listen on (inside their own network namespaces)


def probe(address: str, port: int) -> str:
    return f"timeout 3 bash -c 'echo > /dev/tcp/{address}/{port}' 2>/dev/null && echo open || echo closed"


def listen(port: int) -> str:
    """A listener in the allocation that outlives the SSH session."""
    return (
        f'nohup python3 -c \'import socket, time; s = socket.socket(); s.bind(("", {port})); s.listen(); '
        f"[s.accept() for _ in iter(int, 1)]' >/dev/null 2>&1 & sleep 0.5; echo started"
    )


def networks() -> set[str]:
    return set(podman("network", "ls", "--format", "{{.Name}}").split())


def host_blocks() -> str:
    return iptables("-S", "GPUAAS-INPUT")


def iptables(*args: str, check: bool = False) -> str:
    return subprocess.run(["iptables", "-w", *args], capture_output=True, text=True, check=check).stdout


@pytest.fixture
async def second_host(tmp_path: Path, runtime: dict[str, str]) -> AsyncIterator[Host]:
    host = await start_host(agent_settings(tmp_path / "agent-2", "container"))
    yield host
    await stop_host(host)
    for name in containers_of(host.agent):
        podman("rm", "-f", "-t", "0", name, check=False)


@pytest.fixture
def host_listener() -> Iterator[int]:
    """A service on every host address (0.0.0.0): what an allocation must not reach through its gateway."""
    srv = socket.create_server(("0.0.0.0", 0))
    port = srv.getsockname()[1]
    threading.Thread(target=lambda: [srv.accept() for _ in iter(int, 1)], daemon=True).start()
    yield port
    srv.close()


def in_project(payload: dict[str, Any], project: str) -> dict[str, Any]:
    return {**payload, "project_id": project, "tenant_id": str(uuid.uuid4())}


async def test_project_members_reach_each_other_and_nothing_else(
    container_host: Host, second_host: Host, runtime: dict[str, str], host_listener: int
) -> None:
    h1, h2 = container_host, second_host
    p, q = str(uuid.uuid4()), str(uuid.uuid4())
    a1 = in_project(h1.payload("anna", [0], runtime), p)
    a2 = in_project(h2.payload("alex", [0], runtime), p)  # same project, the other agent
    b1 = in_project(h1.payload("bert", [1], runtime), q)  # another project on the same agent
    r_a1, r_a2, r_b1 = [await h.task("provision", x) for h, x in ((h1, a1), (h2, a2), (h1, b1))]
    net_p, net_q = network_name(p), network_name(q)
    assert r_a1["network"]["name"] == r_a2["network"]["name"] == net_p != r_b1["network"]["name"] == net_q
    addr = {k: r["network"]["address"] for k, r in (("a1", r_a1), ("a2", r_a2), ("b1", r_b1))}
    assert len(set(addr.values())) == 3 and all(addr.values()), addr
    assert r_a1["network"]["hostname"] == f"gpuaas-{uuid.UUID(a1['allocation_id']).hex[-12:]}"
    assert (await h1.ssh("anna", "hostname")).stdout.strip() == r_a1["network"]["hostname"]
    assert (await h1.ssh("anna", "echo $GPUAAS_ALLOCATION_ID")).stdout.strip() == a1["allocation_id"]

    for h, user in ((h1, "anna"), (h2, "alex"), (h1, "bert")):
        assert (await h.ssh(user, listen(PORT))).stdout.strip() == "started"
    assert (await h2.ssh("alex", probe(addr["a1"], PORT))).stdout.strip() == "open"  # across agents
    assert (await h1.ssh("anna", probe(addr["a2"], PORT))).stdout.strip() == "open"
    assert (await h1.ssh("bert", probe(addr["a1"], PORT))).stdout.strip() == "closed"  # other project
    assert (await h1.ssh("anna", probe(addr["b1"], PORT))).stdout.strip() == "closed"

    gateway = (await h1.ssh("anna", "ip route | awk '/^default/ {print $3}'")).stdout.strip()
    assert gateway, "no default route: the allocation has no way out"
    for target in (f"{gateway} {host_listener}", f"{gateway} {h1.port}", f"127.0.0.1 {host_listener}"):
        address, port = target.split()
        seen = (await h1.ssh("anna", probe(address, int(port)))).stdout.strip()
        assert seen == "closed", (target, seen)  # the host (its services, the agent's SSH port) is out of reach
    assert f"-i {podman('network', 'inspect', net_p, '--format', '{{.NetworkInterface}}').strip()} " in host_blocks()

    await h1.task("release", a1)
    assert net_p in networks()  # a2 (the other agent's) still on it
    assert (await h2.ssh("alex", probe(addr["a2"], PORT))).stdout.strip() == "open"
    await h2.task("release", a2)
    await h1.task("release", b1)
    assert not {net_p, net_q} & networks()
    blocks = iptables("-S")
    assert f"gpuaas-net-{net_p[9:]}" not in blocks and f"gpuaas-net-{net_q[9:]}" not in blocks


async def test_payload_without_project_keeps_the_user_mode_network(
    container_host: Host, runtime: dict[str, str]
) -> None:
    p = container_host.payload("erin", [0], runtime)  # an older control plane: no project in the payload
    result = await container_host.task("provision", p)
    assert result["network"] is None
    info = podman("container", "inspect", f"gpuaas-{p['allocation_id']}", "--format", "{{.HostConfig.NetworkMode}}")
    assert info.strip() == "slirp4netns"
    await container_host.task("release", p)


async def test_reconcile_drops_rules_whose_network_is_gone() -> None:
    """A killed agent (or an operator's `podman network rm`) leaves its rules behind, matched by an interface
    name podman will give the next network (and earlier agents' INPUT host blocks); reconciling at start
    deletes them and keeps a live network's rules."""
    nets = ProjectNetworks(Podman(containers_conf=str(CONTAINERS_CONF)))
    live = network_name(str(uuid.uuid4()))
    assert live
    legacy = ["INPUT", "-i", "gpuaas-gone1", "-m", "comment", "--comment", "gpuaas-host-block-0rphan000000", "-j"]
    try:
        async with nets.locked(live):
            await nets.ensure(live)
        await nets.firewall.attach("0rphan", "gpuaas-gone0")  # as a network removed behind the agent's back
        iptables("-I", *legacy, "REJECT", check=True)
        assert "gpuaas-net-0rphan" in iptables("-S") and "gpuaas-host-block-0rphan000000" in iptables("-S")
        report = await nets.reconcile_host()
        assert "0rphan" in report["rules_dropped"]
        rules = iptables("-S")
        assert "gpuaas-net-0rphan" not in rules and "gpuaas-host-block-0rphan000000" not in rules
        assert f"gpuaas-net-{live[9:]}" in host_blocks()  # the live network keeps its rules
    finally:
        iptables("-D", *legacy, "REJECT")
        async with nets.locked(live):
            await nets.remove_if_unused(live)
    assert await nets.leftovers(live) == [] and live not in networks()
