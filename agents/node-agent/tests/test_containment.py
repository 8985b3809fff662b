"""Containment by default (issue 27 item 2): from inside an allocation, as its user with sudo, the metadata
service (IPv4 and IPv6), every host address and the agent's port, the host's IPv6 link-local address, another
podman network's member (a compose deployment's Kafka/Postgres stand-in) and another project's member are
refused or unreachable within 3 s; the outside works through NAT and an allow-list narrows it; the rules come
back when the agent restarts. The container runs with no-new-privileges and few capabilities, and sudo still
installs a package.

Every probe target is on this machine. The metadata service and the "outside" server are fakes in network
namespaces this test creates (veth pairs), at 169.254.169.254 / fd00:ec2::254 and at 203.0.113.10
(TEST-NET-3, routed to the fake); before any probe the test checks, in the container's network namespace and in
the host's forwarding decision for the container's packets, that each target's route ends at a fake, at a
bridge of this machine or at the host itself, so that a missing rule could never send a packet out."""

from __future__ import annotations

import ipaddress
import json
import random
import shlex
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_harness import Host, agent_settings, containers_of, needs_podman, podman, start_host, stop_host

from gpuaas.node_agent.drivers.container import container_name
from gpuaas.node_agent.firewall import EgressPolicy, Firewall
from gpuaas.node_agent.project_network import LOCK_DIR, network_name

pytestmark = needs_podman
OUTSIDE = "203.0.113.10"
METADATA_V4, METADATA_V6 = "169.254.169.254", "fd00:ec2::254"
PEER_PORT = 18080
CAP_BOUND = 0x4FB  # CHOWN DAC_OVERRIDE FOWNER FSETID KILL SETGID SETUID NET_BIND_SERVICE

# Greets with its name, so "open" says who answered.
SERVER = """
import socket, sys, threading
s = socket.socket(socket.AF_INET6); s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("::", int(sys.argv[1]))); s.listen(16)
while True:
    c, _ = s.accept(); c.sendall(sys.argv[2].encode() + b"\\n"); c.close()
"""
PROBE = """
import json, socket, sys, time
out = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    started = time.monotonic()
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(3)
    try:
        s.connect(socket.getaddrinfo(host, int(port), family, socket.SOCK_STREAM)[0][4])
        result = "open " + s.recv(64).decode(errors="replace").strip()
    except ConnectionRefusedError:
        result = "refused"
    except socket.timeout:
        result = "timeout"
    except OSError as exc:
        result = f"unreachable ({exc.strerror})"
    finally:
        s.close()
    out[target] = [result, round(time.monotonic() - started, 2)]
print(json.dumps(out))
"""


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=60)


class Fake:
    """A server in a network namespace of its own, joined to the host by a veth pair."""

    def __init__(self, tag: str) -> None:
        self.ns, self.host_if, self.ns_if = f"gpuaas-fake-{tag}", f"gfh{tag}", f"gfn{tag}"
        self.server: subprocess.Popen[bytes] | None = None

    def up(self, host_addrs: list[str], ns_addrs: list[str], ns_lo: list[str], ns_routes: list[list[str]]) -> None:
        run("ip", "netns", "add", self.ns)
        run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if, "netns", self.ns)
        for a in host_addrs:
            run("ip", "addr", "add", a, "dev", self.host_if, *(["nodad"] if ":" in a else []))
        run("ip", "link", "set", self.host_if, "up")
        inside = ["ip", "netns", "exec", self.ns]
        run(*inside, "ip", "link", "set", "lo", "up")
        for a in ns_addrs:
            run(*inside, "ip", "addr", "add", a, "dev", self.ns_if, *(["nodad"] if ":" in a else []))
        for a in ns_lo:
            run(*inside, "ip", "addr", "add", a, "dev", "lo")
        run(*inside, "ip", "link", "set", self.ns_if, "up")
        for r in ns_routes:
            run(*inside, "ip", *r)

    def serve(self, port: int, greeting: str) -> None:
        self.server = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, sys.executable, "-c", SERVER, str(port), greeting]
        )

    def down(self) -> None:
        if self.server is not None:
            self.server.kill()
            self.server.wait()
        run("ip", "netns", "del", self.ns, check=False)  # takes its end of the veth, and so both ends
        run("ip", "link", "del", self.host_if, check=False)


@pytest.fixture
def fakes() -> Iterator[dict[str, Any]]:
    """The metadata service and an outside server, each routed into a namespace of its own on this machine."""
    tag = uuid.uuid4().hex[:5]
    meta, outside = Fake(f"m{tag}"), Fake(f"o{tag}")
    # The link to the outside fake: a /30 of TEST-NET-2 that no host interface is on (hosts here may have
    # their underlay in a documentation range).
    taken = [ipaddress.ip_network(f"{a}/24", strict=False) for a in host_addresses() if ":" not in a]
    free = [b for b in range(0, 256, 4) if not any(ipaddress.ip_address(f"198.51.100.{b}") in n for n in taken)]
    block = random.choice(free)
    link_host, link_fake = f"198.51.100.{block + 1}", f"198.51.100.{block + 2}"
    try:
        meta.up(["169.254.169.253/30", "fd00:ec2::1/64"], [f"{METADATA_V4}/30", f"{METADATA_V6}/64"], [], [])
        meta.serve(80, "fake-metadata")
        outside.up(
            [f"{link_host}/30"], [f"{link_fake}/30"], [f"{OUTSIDE}/32"], [["route", "add", "default", "via", link_host]]
        )
        run("ip", "route", "add", f"{OUTSIDE}/32", "via", link_fake, "dev", outside.host_if)
        outside.serve(80, "fake-outside")
        yield {"metadata": meta, "outside": outside}
    finally:
        run("ip", "route", "del", f"{OUTSIDE}/32", check=False)
        meta.down()
        outside.down()


@pytest.fixture
def host_listener() -> Iterator[int]:
    """A service on every host address, IPv4 and IPv6 (link-local included): what allocations must not reach."""
    srv = socket.socket(socket.AF_INET6)
    srv.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    srv.bind(("::", 0))
    srv.listen()

    def serve() -> None:
        while True:
            try:
                srv.accept()[0].close()
            except OSError:  # closed at the end of the test
                return

    threading.Thread(target=serve, daemon=True).start()
    yield srv.getsockname()[1]
    srv.close()


@pytest.fixture
def compose_member(runtime: dict[str, str]) -> Iterator[str]:
    """A container on a plain (non-project) podman network: the compose deployment's Kafka/Postgres."""
    tag = uuid.uuid4().hex[:8]
    net, name = f"gpuaas-compose-{tag}", f"gpuaas-compose-db-{tag}"
    podman("network", "create", net)
    try:
        podman("pull", "--tls-verify=false", runtime["image"])
        podman("run", "-d", "--name", name, "--network", net, runtime["image"], "python3", "-c", SERVER, "5432", "db")
        yield json.loads(podman("inspect", name))[0]["NetworkSettings"]["Networks"][net]["IPAddress"]
    finally:
        podman("rm", "-f", "-t", "0", name, check=False)
        podman("network", "rm", net, check=False)


@pytest.fixture
async def agent_host(tmp_path: Path, runtime: dict[str, str]) -> AsyncIterator[Host]:
    host = await start_host(agent_settings(tmp_path / "agent", "container"))
    yield host
    await stop_host(host)
    for name in containers_of(host.agent):
        podman("rm", "-f", "-t", "0", name, check=False)


def in_project(payload: dict[str, Any], project: str) -> dict[str, Any]:
    return {**payload, "project_id": project, "tenant_id": str(uuid.uuid4())}


def route(*args: str, pid: int | None = None) -> dict[str, Any] | None:
    """`ip -j route get ...`, in the container's network namespace when `pid` is given; None: no route."""
    argv = ["nsenter", "-t", str(pid), "-n"] if pid else []
    done = run(*argv, "ip", "-j", *args, check=False)
    return json.loads(done.stdout)[0] if done.returncode == 0 and done.stdout.strip() else None


def host_addresses() -> list[str]:
    """Every address of this machine but loopback (IPv6 link-local ones are probed on the bridge only)."""
    out = []
    for link in json.loads(run("ip", "-j", "addr", "show").stdout):
        for a in link.get("addr_info") or []:
            if a.get("scope") == "host" or a["local"].startswith("fe80:"):
                continue
            out.append(a["local"])
    return out


def target(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


async def probe(host: Host, user: str, targets: list[str], sudo: bool = True) -> dict[str, list[Any]]:
    command = f"{'sudo ' if sudo else ''}python3 -c {shlex.quote(PROBE)} {' '.join(targets)}"
    done = await host.ssh(user, command, timeout=120)
    assert done.exit_status == 0, (done.stdout, done.stderr)
    return json.loads(str(done.stdout))


async def test_allocation_reaches_the_outside_and_nothing_internal(
    agent_host: Host,
    runtime: dict[str, str],
    fakes: dict[str, Any],
    host_listener: int,
    compose_member: str,
    tmp_path: Path,
) -> None:
    h = agent_host
    project, other = str(uuid.uuid4()), str(uuid.uuid4())
    a = in_project(h.payload("ines", [0], runtime), project)
    b = in_project(h.payload("owen", [1], runtime), other)
    ra, rb = await h.task("provision", a), await h.task("provision", b)
    started = await h.ssh("owen", f"nohup python3 -c {shlex.quote(SERVER)} {PEER_PORT} peer >/dev/null 2>&1 & echo ok")
    assert started.stdout.strip() == "ok"
    net = str(network_name(project))
    info = json.loads(podman("network", "inspect", net))[0]
    bridge, gateway = info["network_interface"], info["subnets"][0]["gateway"]
    me = ra["network"]["address"]
    pid = int(json.loads(podman("inspect", container_name(a["allocation_id"])))[0]["State"]["Pid"])
    link_local = next(
        x["local"]
        for x in json.loads(run("ip", "-j", "addr", "show", "dev", bridge).stdout)[0]["addr_info"]
        if x["local"].startswith("fe80:")
    )

    # ---- where each target's packets would go: never out of this machine
    defaults = json.loads(run("ip", "-j", "route", "show", "default").stdout or "[]")
    default_dev = defaults[0].get("dev") if defaults else None  # what would carry a packet off this machine
    blocked = {
        "metadata": [target(METADATA_V4, 80), target(METADATA_V6, 80)],
        "host": [target(x, host_listener) for x in host_addresses()] + [target(gateway, h.port)],
        "host link-local": [f"[{link_local}%eth0]:{host_listener}"],
        "compose network": [target(compose_member, 5432)],
        "other project": [target(rb["network"]["address"], PEER_PORT)],
    }
    for group, targets in blocked.items():
        for t in targets:
            address = t.rsplit(":", 1)[0].strip("[]").split("%")[0]
            inside = route("route", "get", address, pid=pid)
            if ":" in address and not address.startswith("fe80:"):
                assert inside is None, (t, inside)  # no IPv6 route out of the container at all
                outer = route("-6", "route", "get", address)
                assert outer and outer.get("dev") != default_dev, (t, outer)
                continue
            assert inside and inside.get("dev") == "eth0", (t, inside)
            if ":" in address:
                continue  # link-local: on the bridge, the host itself
            outer = route("route", "get", address, "from", me, "iif", bridge)
            assert outer, (t, outer)
            if outer.get("type") != "local":
                assert outer.get("dev") not in (None, default_dev), (group, t, outer)
    for address, fake in ((METADATA_V4, fakes["metadata"]), (OUTSIDE, fakes["outside"])):
        outer = route("route", "get", address, "from", me, "iif", bridge)
        assert outer and outer["dev"] == fake.host_if, (address, outer)  # the fake, not the real one
    assert (route("-6", "route", "get", METADATA_V6) or {}).get("dev") == fakes["metadata"].host_if

    # ---- the probes, as the allocation's user through sudo (root of the container)
    everything = [t for ts in blocked.values() for t in ts] + [target(OUTSIDE, 80)]
    seen = await probe(h, "ines", everything)
    print(json.dumps(seen, indent=1))
    for group, targets in blocked.items():
        for t in targets:
            result, took = seen[t]
            assert result.startswith(("refused", "unreachable")) and took < 3, (group, t, result, took)
    assert seen[target(OUTSIDE, 80)][0] == "open fake-outside", seen
    # The fakes really answer (a blocked probe is the rules' doing, not a dead fake): from the host itself.
    for address in (METADATA_V4, OUTSIDE):
        with socket.create_connection((address, 80), timeout=3) as s:
            assert s.recv(64).startswith(b"fake-")
    # The other project's member is alive: its own user reaches it.
    own = await probe(h, "owen", [target(rb["network"]["address"], PEER_PORT)], sudo=False)
    assert own[target(rb["network"]["address"], PEER_PORT)][0] == "open peer"

    # ---- an operator's allow-list narrows the outside (the shared egress chain, rebuilt), then back
    key = net.removeprefix("gpuaas-p-")
    await Firewall(LOCK_DIR, EgressPolicy.build(["198.51.100.0/24:443"], None)).attach(key, bridge)
    try:
        narrowed = await probe(h, "ines", [target(OUTSIDE, 80)], sudo=False)
        assert narrowed[target(OUTSIDE, 80)][0].startswith(("refused", "unreachable")), narrowed
    finally:
        await Firewall(LOCK_DIR, EgressPolicy.build(None, None)).attach(key, bridge)
    assert (await probe(h, "ines", [target(OUTSIDE, 80)], sudo=False))[target(OUTSIDE, 80)][0] == "open fake-outside"

    # ---- the rules survive an agent restart: lost (as by a firewall reload) while it is down, back at start
    await stop_host(h)
    run("iptables", "-w", "-D", "FORWARD", "-j", "GPUAAS-FORWARD")
    assert "-j GPUAAS-FORWARD" not in run("iptables", "-S", "FORWARD").stdout
    restarted = await start_host(agent_settings(tmp_path / "agent", "container"))
    restarted.keys = h.keys
    h.agent = restarted.agent  # the fixture stops this one
    forward = [x for x in run("iptables", "-S", "FORWARD").stdout.splitlines() if x.startswith("-A")]
    assert forward[0] == "-A FORWARD -j GPUAAS-FORWARD", forward  # first again, ahead of podman's accept
    again = await probe(restarted, "ines", [target(METADATA_V4, 80), target(compose_member, 5432)])
    assert all(r.startswith(("refused", "unreachable")) for r, _ in again.values()), again


async def test_no_new_privileges_few_capabilities_and_sudo_installs_a_package(
    agent_host: Host, runtime: dict[str, str]
) -> None:
    h = agent_host
    p = in_project(h.payload("vera", [0], runtime), str(uuid.uuid4()))
    await h.task("provision", p)
    status = (await h.ssh("vera", "grep -E '^(NoNewPrivs|CapBnd|CapEff)' /proc/self/status")).stdout
    fields = dict(line.split(":\t") for line in str(status).splitlines())
    assert fields["NoNewPrivs"] == "1" and int(fields["CapBnd"], 16) == CAP_BOUND, fields
    # The image's setuid sudo is stopped by no-new-privileges; the broker's sudo is what sessions get.
    setuid = await h.ssh("vera", "/usr/bin/sudo -n true")
    assert setuid.exit_status != 0 and "no new privileges" in str(setuid.stderr)
    assert (await h.ssh("vera", "command -v sudo; sudo -n id -u; sudo -u vera id -un")).stdout.split() == [
        "/usr/local/bin/sudo",
        "0",
        "vera",
    ]
    root_caps = (await h.ssh("vera", "sudo grep -E '^(CapEff|NoNewPrivs)' /proc/self/status")).stdout
    assert "NoNewPrivs:\t1" in str(root_caps) and int(str(root_caps).split("CapEff:\t")[1].split()[0], 16) == CAP_BOUND
    # Exit status, stdin and a signal go through the broker.
    assert (await h.ssh("vera", "sudo sh -c 'exit 7'; echo $?")).stdout.strip() == "7"
    assert (await h.ssh("vera", "echo secret | sudo cat")).stdout.strip() == "secret"
    interrupted = "timeout -s INT 1 sudo sleep 30; sleep 0.5; ps -eo args | grep -cx 'sleep 30' || true"
    assert (await h.ssh("vera", interrupted)).stdout.strip() == "0"  # the client's SIGINT reached the command
    # A package install (offline: a package built here; apt drops to its _apt user, dpkg chowns its files).
    build = (
        "set -e; d=$(mktemp -d); mkdir -p $d/pkg/DEBIAN $d/pkg/usr/share/gpuaas-probe;"
        " printf 'Package: gpuaas-probe\\nVersion: 1.0\\nArchitecture: all\\nMaintainer: t <t@example.org>\\n"
        "Description: probe\\n' > $d/pkg/DEBIAN/control; echo installed > $d/pkg/usr/share/gpuaas-probe/file;"
        " dpkg-deb --root-owner-group --build $d/pkg $HOME/probe.deb >/dev/null;"
        " sudo apt-get install -y -q $HOME/probe.deb >/dev/null 2>&1;"
        " dpkg-query -W -f='${Status}\\n' gpuaas-probe; cat /usr/share/gpuaas-probe/file;"
        " stat -c %U /usr/share/gpuaas-probe/file; sudo apt-get remove -y -q gpuaas-probe >/dev/null 2>&1;"
        " test ! -e /usr/share/gpuaas-probe/file && echo removed"
    )
    done = await h.ssh("vera", build, timeout=180)
    assert done.stdout.splitlines() == ["install ok installed", "installed", "root", "removed"], (
        done.stdout,
        done.stderr,
    )
    await h.task("release", p)
