"""A project's overlay across hosts (issue 27 items 1 and 4): hosts simulated as network namespaces on a test
underlay (veth pairs into a bridge in an underlay namespace, 198.18.77.0/24), each running the agent's real
overlay and containment code in its own namespace (overlay_host.py: overlay.join/leave, Firewall.attach);
members are network namespaces standing in for containers, attached to the project's bridge as podman attaches
one (a veth, the address and MAC the control plane gives, the overlay's MTU), with /etc/netns/<member>/hosts as
their /etc/hosts.

- a member on host A reaches one on host B by name, and the traffic crosses the underlay (VXLAN counters);
- another project's members on the same two hosts cannot reach the first's, in either direction, nor the
  other way round (refused by the containment rules although the target listens and forwarding is on);
- VXLAN from an address on the underlay that is not a peer is dropped; the same frame from a peer arrives;
- a name still resolves to a reachable member after the member is restarted and after it moves to host C;
- leaving a segment leaves no device, FDB entry, ebtables or iptables rule behind.

Every namespace, link and address is this test's own; no packet leaves the machine."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_harness import Host, needs_podman, podman

from gpuaas.contracts.agent import OverlaySpec
from gpuaas.node_agent import overlay
from gpuaas.node_agent.project_network import network_name

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "bridge", "ebtables", "iptables-restore")),
    reason="needs root and iproute2/ebtables/iptables: builds network namespaces, bridges and VXLAN devices",
)
HERE = Path(__file__).parent
UNDERLAY = "198.18.77"
PORT = 18080
P = {"vni": 4101, "subnet": "10.231.0.0/24", "bridge": "gpb-p"}
Q = {"vni": 4102, "subnet": "10.232.0.0/24", "bridge": "gpb-q"}

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(16)
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("0.0.0.0", int(sys.argv[1])))
import threading
def datagrams():
    while True:
        data, _ = u.recvfrom(2048); print(data.decode(errors="replace"), flush=True)
threading.Thread(target=datagrams, daemon=True).start()
print("ready", flush=True)
while True:
    c, _ = s.accept(); c.sendall(sys.argv[2].encode() + b"\\n"); c.close()
"""
PROBE = """
import json, socket, sys
out = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    s = socket.socket(); s.settimeout(3)
    try:
        s.connect((socket.gethostbyname(host), int(port)))
        out[target] = "open " + s.recv(64).decode(errors="replace").strip()
    except ConnectionRefusedError:
        out[target] = "refused"
    except socket.timeout:
        out[target] = "timeout"
    except OSError as exc:
        out[target] = f"unreachable ({exc.strerror})"
    finally:
        s.close()
print(json.dumps(out))
"""


def sh(*argv: str, check: bool = True) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=60).stdout


class Member:
    """A namespace standing in for a container on a project bridge."""

    def __init__(self, fabric: Fabric, name: str, host: str, project: dict[str, Any], address: str) -> None:
        self.fabric, self.name, self.host, self.project, self.address = fabric, name, host, project, address
        self.ns = f"gpuaas-m{name}-{fabric.tag}"
        self.link = f"gm{name}{fabric.tag}"[:15]
        self.server: subprocess.Popen[str] | None = None

    @property
    def hosts_file(self) -> Path:
        return Path("/etc/netns") / self.ns / "hosts"

    def up(self) -> None:
        net = overlay.segment(self.project["vni"], self.project["subnet"], f"{UNDERLAY}.1")
        hns = self.fabric.hosts[self.host]
        sh("ip", "netns", "add", self.ns)
        sh("ip", "-n", hns, "link", "add", self.link, "type", "veth", "peer", "name", "eth0", "netns", self.ns)
        mtu = str(overlay.member_mtu())
        sh("ip", "-n", hns, "link", "set", self.link, "mtu", mtu, "master", self.project["bridge"], "up")
        inside = ("ip", "-n", self.ns)
        sh(*inside, "link", "set", "lo", "up")
        sh(*inside, "link", "set", "eth0", "address", overlay.member_mac(self.address), "mtu", mtu, "up")
        sh(*inside, "addr", "add", f"{self.address}/{net.subnet.prefixlen}", "dev", "eth0")
        sh(*inside, "route", "add", "default", "via", str(net.gateway))
        self.hosts_file.parent.mkdir(parents=True, exist_ok=True)
        self.hosts_file.write_text(f"127.0.0.1\tlocalhost\n{self.address}\t{self.name}\n")
        self.server = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, sys.executable, "-c", SERVER, str(PORT), self.name],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.server.stdout is not None and self.server.stdout.readline().strip() == "ready"

    def down(self) -> None:
        if self.server is not None:
            self.server.kill()
            self.server.wait()
            self.server = None
        # The host's end first: a namespace is torn down asynchronously, and a restart reuses the link's name.
        sh("ip", "-n", self.fabric.hosts[self.host], "link", "del", self.link, check=False)
        sh("ip", "netns", "del", self.ns, check=False)
        shutil.rmtree(self.hosts_file.parent, ignore_errors=True)

    def probe(self, *targets: str) -> dict[str, str]:
        out = sh("ip", "netns", "exec", self.ns, sys.executable, "-c", PROBE, *targets)
        return json.loads(out)

    def getent(self, name: str) -> str:
        return sh("ip", "netns", "exec", self.ns, "getent", "hosts", name, check=False).split("\n")[0]

    def received(self, want: str) -> list[str]:
        """Datagrams the member got, read until `want` arrives (the probe that must come last)."""
        assert self.server is not None and self.server.stdout is not None
        seen: list[str] = []
        while want not in seen:
            line = self.server.stdout.readline()
            assert line, f"server of {self.name} ended before {want!r} arrived: {seen}"
            seen.append(line.strip())
        return seen


class Fabric:
    """An underlay bridge (in a namespace of its own) and hosts joined to it."""

    def __init__(self, tmp: Path) -> None:
        self.tag = uuid.uuid4().hex[:4]
        self.tmp = tmp
        self.underlay = f"gpuaas-ul-{self.tag}"
        self.hosts: dict[str, str] = {}
        self.members: dict[str, Member] = {}
        sh("ip", "netns", "add", self.underlay)
        sh("ip", "-n", self.underlay, "link", "add", "ul", "type", "bridge")
        sh("ip", "-n", self.underlay, "addr", "add", f"{UNDERLAY}.250/24", "dev", "ul")  # the "rogue" LAN box
        sh("ip", "-n", self.underlay, "link", "set", "ul", "up")

    def underlay_ip(self, host: str) -> str:
        return f"{UNDERLAY}.{'abc'.index(host) + 1}"

    def add_host(self, host: str) -> None:
        ns = self.hosts[host] = f"gpuaas-h{host}-{self.tag}"
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "add", "ul0", "type", "veth", "peer", "name", f"u{host}", "netns", self.underlay)
        sh("ip", "-n", self.underlay, "link", "set", f"u{host}", "master", "ul", "up")
        sh("ip", "-n", ns, "addr", "add", f"{self.underlay_ip(host)}/24", "dev", "ul0")
        sh("ip", "-n", ns, "link", "set", "ul0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")  # as podman sets it on a host

    def bridge(self, host: str, project: dict[str, Any]) -> None:
        """The project's network on the host, as podman makes it: a bridge holding the gateway address."""
        net = overlay.segment(project["vni"], project["subnet"], self.underlay_ip(host))
        ns = self.hosts[host]
        sh("ip", "-n", ns, "link", "add", project["bridge"], "type", "bridge")
        sh("ip", "-n", ns, "addr", "add", f"{net.gateway}/{net.subnet.prefixlen}", "dev", project["bridge"])
        sh("ip", "-n", ns, "link", "set", project["bridge"], "up")

    def member(self, name: str, host: str, project: dict[str, Any], address: str) -> Member:
        m = self.members[name] = Member(self, name, host, project, address)
        m.up()
        return m

    def agent(self, host: str, request: dict[str, Any]) -> dict[str, Any]:
        """The agent's code, run in the host's namespace."""
        req = self.tmp / f"req-{uuid.uuid4().hex[:6]}.json"
        req.write_text(json.dumps({"lock_dir": str(self.tmp / f"lock-{host}"), **request}))
        out = sh("ip", "netns", "exec", self.hosts[host], sys.executable, str(HERE / "overlay_host.py"), str(req))
        return json.loads(out)

    def sync(self, project: dict[str, Any]) -> None:
        """What the control plane does when members come and go: every host of the project gets the segment
        with the current peers, its names go into every member's hosts file; a host left without a member of
        the project leaves the segment."""
        members = [m for m in self.members.values() if m.project is project and m.server is not None]
        by_host: dict[str, list[str]] = {}
        for m in members:
            by_host.setdefault(m.host, []).append(m.address)
        peers = [[self.underlay_ip(h), addrs] for h, addrs in sorted(by_host.items())]
        for host in self.hosts:
            if host in by_host:
                seg = {"vni": project["vni"], "subnet": project["subnet"], "local": self.underlay_ip(host)}
                self.agent(host, {"op": "join", "bridge": project["bridge"], "segment": {**seg, "peers": peers}})
            elif project["vni"] in self.segments(host):
                self.agent(host, {"op": "leave", "bridge": project["bridge"], "vni": project["vni"]})
        names = {f"{m.name}.proj-{project['bridge'][-1]}": overlay.IPv4(m.address) for m in members}
        for m in members:
            overlay.write_hosts(m.hosts_file, names)

    def segments(self, host: str) -> dict[int, str]:
        out = sh("ip", "-n", self.hosts[host], "-j", "-d", "link", "show", "type", "vxlan")
        return {
            link["linkinfo"]["info_data"]["id"]: link.get("master", "")
            for link in json.loads(out or "[]")
            if link["ifname"].startswith(overlay.PREFIX)
        }

    def vxlan_packets(self, host: str, vni: int) -> tuple[int, int]:
        out = sh("ip", "-n", self.hosts[host], "-j", "-s", "link", "show", overlay.vxlan_name(vni))
        stats = json.loads(out)[0]["stats64"]
        return stats["tx"]["packets"], stats["rx"]["packets"]

    def close(self) -> None:
        for m in self.members.values():
            m.down()
        for ns in self.hosts.values():
            sh("ip", "netns", "del", ns, check=False)
        sh("ip", "netns", "del", self.underlay, check=False)


def test_the_plan_gives_the_forwarding_table_and_the_hosts_block() -> None:
    """Without root: what join() writes follows from the segment alone."""
    seg = overlay.segment(
        4101, "10.231.0.0/24", "198.18.77.1", [("198.18.77.1", ["10.231.0.10"]), ("198.18.77.2", ["10.231.0.20"])]
    )
    assert str(seg.gateway) == "10.231.0.1" and seg.device == "gpuaas-v1005"
    assert seg.fdb() == {("00:00:00:00:00:00", "198.18.77.2"), ("0a:58:0a:e7:00:14", "198.18.77.2")}  # not itself
    with pytest.raises(overlay.OverlayError):
        overlay.segment(1 << 24, "10.231.0.0/24", "198.18.77.1")
    with pytest.raises(overlay.OverlayError):
        overlay.segment(7, "10.231.0.0/24", "198.18.77.1", names={"x.p": "10.9.9.9"})  # outside the subnet
    first = overlay.hosts_text("127.0.0.1\tlocalhost\n", {"b.p": overlay.IPv4("10.231.0.20")})
    again = overlay.hosts_text(first, {"c.p": overlay.IPv4("10.231.0.30")})  # the block is replaced, the rest kept
    assert again.startswith("127.0.0.1\tlocalhost\n") and overlay.resolve(again, "c.p") == ["10.231.0.30"]
    assert overlay.resolve(again, "b.p") == []


@pytest.fixture
def fabric(tmp_path: Path) -> Iterator[Fabric]:
    """Hosts A and B, projects P and Q on both; members alpha (P, A), beta (P, B), gamma (Q, A), delta (Q, B)."""
    f = Fabric(tmp_path)
    try:
        for host in "ab":
            f.add_host(host)
            f.bridge(host, P)
            f.bridge(host, Q)
        f.member("alpha", "a", P, "10.231.0.10")
        f.member("beta", "b", P, "10.231.0.20")
        f.member("gamma", "a", Q, "10.232.0.10")
        f.member("delta", "b", Q, "10.232.0.20")
        f.sync(P)
        f.sync(Q)
        yield f
    finally:
        f.close()


@needs_root
def test_members_on_two_hosts_reach_each_other_by_name_over_the_underlay(fabric: Fabric) -> None:
    alpha, beta = fabric.members["alpha"], fabric.members["beta"]
    assert alpha.getent("beta.proj-p").split() == ["10.231.0.20", "beta.proj-p"]
    tx_before, _ = fabric.vxlan_packets("a", P["vni"])
    _, rx_before = fabric.vxlan_packets("b", P["vni"])
    assert alpha.probe(f"beta.proj-p:{PORT}") == {f"beta.proj-p:{PORT}": "open beta"}
    assert beta.probe(f"alpha.proj-p:{PORT}") == {f"alpha.proj-p:{PORT}": "open alpha"}
    tx_after, _ = fabric.vxlan_packets("a", P["vni"])
    _, rx_after = fabric.vxlan_packets("b", P["vni"])
    assert tx_after > tx_before and rx_after > rx_before  # through the VXLAN ports, so across the underlay
    # Forwarding is static: the peer's flood entry and the remote member's MAC, nothing learned.
    fdb = sh("bridge", "-n", fabric.hosts["a"], "fdb", "show", "dev", overlay.vxlan_name(P["vni"]))
    assert f"00:00:00:00:00:00 dst {UNDERLAY}.2" in fdb and f"{overlay.member_mac('10.231.0.20')} dst" in fdb
    # Projects are segments of their own: Q's names are not in P's members.
    assert alpha.getent("delta.proj-q") == ""


@needs_root
def test_another_project_cannot_reach_the_first_in_either_direction(fabric: Fabric) -> None:
    m = fabric.members
    # Q's members target P's (on the other host and on their own) and P's target Q's: each one listens (a P
    # member reaches its peer), so a refusal is the containment rules' (GPUAAS-EGRESS, forwarding is on).
    assert m["alpha"].probe(f"10.231.0.20:{PORT}")[f"10.231.0.20:{PORT}"] == "open beta"
    crossings = [("gamma", "10.231.0.20"), ("gamma", "10.231.0.10"), ("delta", "10.231.0.10")]
    crossings += [("alpha", "10.232.0.20"), ("beta", "10.232.0.10"), ("beta", "10.232.0.20")]
    for source, target in crossings:
        result = m[source].probe(f"{target}:{PORT}")[f"{target}:{PORT}"]
        # Refused at once: the target's host (or the source's) rejects it (GPUAAS-REJECT's TCP reset).
        assert result == "refused", f"{source} → {target}: {result}"
    # Nor through another host's underlay address (a member cannot send VXLAN itself: the underlay is internal).
    result = m["gamma"].probe(f"{UNDERLAY}.2:{overlay.VXLAN_PORT}")[f"{UNDERLAY}.2:{overlay.VXLAN_PORT}"]
    assert not result.startswith("open")


def vxlan_frame(vni: int, dst_ip: str, payload: bytes) -> bytes:
    """A VXLAN datagram's payload carrying an Ethernet/IPv4/UDP frame to `dst_ip` (port PORT)."""
    src_ip = "10.231.0.99"
    udp = struct.pack("!HHHH", 40000, PORT, 8 + len(payload), 0) + payload
    header = struct.pack(
        "!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, 17, 0, *(map(socket.inet_aton, (src_ip, dst_ip)))
    )
    words = struct.unpack("!10H", header)
    total = sum(words)
    total = (total & 0xFFFF) + (total >> 16)
    header = header[:10] + struct.pack("!H", ~((total & 0xFFFF) + (total >> 16)) & 0xFFFF) + header[12:]
    eth = bytes.fromhex(overlay.member_mac(dst_ip).replace(":", "")) + bytes.fromhex("0a58dead0001") + b"\x08\x00"
    return struct.pack("!II", 0x08000000, vni << 8) + eth + header + udp


SEND = "import socket, sys; socket.socket(2, 2).sendto(bytes.fromhex(sys.argv[1]), (sys.argv[2], 4789))"


@needs_root
def test_vxlan_from_a_non_peer_on_the_underlay_is_dropped(fabric: Fabric) -> None:
    alpha = fabric.members["alpha"]
    target = fabric.underlay_ip("a")
    rogue = vxlan_frame(P["vni"], alpha.address, b"rogue").hex()
    control = vxlan_frame(P["vni"], alpha.address, b"control").hex()
    sh("ip", "netns", "exec", fabric.underlay, sys.executable, "-c", SEND, rogue, target)  # 198.18.77.250
    sh("ip", "netns", "exec", fabric.hosts["b"], sys.executable, "-c", SEND, control, target)  # a peer
    assert "rogue" not in alpha.received("control")
    rules = sh("ip", "netns", "exec", fabric.hosts["a"], "iptables", "-S", overlay.GUARD)
    assert f"-s {UNDERLAY}.2/32" in rules and f"-s {UNDERLAY}.250" not in rules


@needs_root
def test_names_follow_a_member_restarted_and_moved_to_another_host(fabric: Fabric) -> None:
    alpha = fabric.members["alpha"]
    beta = fabric.members["beta"]
    beta.down()  # a restart: the container is made again, with the address the allocation keeps
    beta.up()
    fabric.sync(P)
    assert alpha.probe(f"beta.proj-p:{PORT}") == {f"beta.proj-p:{PORT}": "open beta"}
    # The allocation comes back on host C (same address): C joins, B has no P member left and leaves P.
    fabric.add_host("c")
    fabric.bridge("c", P)
    beta.down()
    del fabric.members["beta"]
    fabric.member("beta", "c", P, "10.231.0.20")
    fabric.sync(P)
    assert alpha.getent("beta.proj-p").split()[0] == "10.231.0.20"
    assert alpha.probe(f"beta.proj-p:{PORT}") == {f"beta.proj-p:{PORT}": "open beta"}
    assert P["vni"] not in fabric.segments("b") and Q["vni"] in fabric.segments("b")
    fdb = sh("bridge", "-n", fabric.hosts["a"], "fdb", "show", "dev", overlay.vxlan_name(P["vni"]))
    assert f"dst {UNDERLAY}.2" not in fdb and f"{overlay.member_mac('10.231.0.20')} dst {UNDERLAY}.3" in fdb


@needs_root
def test_leaving_every_segment_leaves_nothing_on_the_host(fabric: Fabric) -> None:
    ns = fabric.hosts["a"]
    for project in (P, Q):
        fabric.agent("a", {"op": "leave", "bridge": project["bridge"], "vni": project["vni"]})
    assert fabric.segments("a") == {}
    assert "gpuaas-v" not in sh("ip", "netns", "exec", ns, "ebtables", "-L")
    for tool in ("iptables", "ip6tables"):
        assert "GPUAAS-" not in sh("ip", "netns", "exec", ns, tool, "-S")
    # The other host is untouched and joins again as before (join is idempotent).
    assert set(fabric.segments("b")) == {P["vni"], Q["vni"]}
    fabric.sync(P)
    assert fabric.members["alpha"].probe(f"beta.proj-p:{PORT}") == {f"beta.proj-p:{PORT}": "open beta"}


@needs_root
@needs_podman
async def test_the_container_driver_puts_its_members_on_the_segment(
    container_host: Host, runtime: dict[str, str]
) -> None:
    """The real driver with an overlay payload (one host: the segment's only peer, so no VXLAN datagram is sent):
    the project network on the segment's subnet, each container at the address and MAC the control plane gave,
    the bridge's VXLAN port, the names in every member; a restart keeps both; release leaves nothing."""
    h = container_host
    project, vni, subnet = str(uuid.uuid4()), 4301, "10.235.0.0/24"
    names = {"anna.proj": "10.235.0.2", "alex.proj": "10.235.0.3"}

    def payload(user: str, gpu: int, address: str) -> dict[str, Any]:
        peers = [{"underlay": "127.0.0.1", "addresses": sorted(names.values())}]
        segment = {"vni": vni, "subnet": subnet, "address": address, "underlay": "127.0.0.1", "peers": peers}
        base = h.payload(user, [gpu], runtime)
        return {**base, "project_id": project, "tenant_id": str(uuid.uuid4()), "overlay": {**segment, "names": names}}

    a, b = payload("anna", 0, "10.235.0.2"), payload("alex", 1, "10.235.0.3")
    r_a, r_b = await h.task("provision", a), await h.task("provision", b)
    assert (r_a["network"]["address"], r_b["network"]["address"]) == ("10.235.0.2", "10.235.0.3")
    assert r_a["network"]["scope"] == "project"
    network = network_name(project)
    assert network
    info = json.loads(podman("network", "inspect", network))[0]
    assert [s["subnet"] for s in info["subnets"]] == [subnet] and info["subnets"][0]["gateway"] == "10.235.0.1"
    assert (await h.ssh("alex", "cat /sys/class/net/eth0/address")).stdout.strip() == overlay.member_mac("10.235.0.3")
    links = json.loads(sh("ip", "-j", "-d", "link", "show", overlay.vxlan_name(vni)))
    assert links[0]["master"] == info["network_interface"] and links[0]["linkinfo"]["info_data"]["id"] == vni

    server = f"import socket; s = socket.create_server(('', {PORT})); [s.accept() for _ in iter(int, 1)]"
    listen = f'nohup python3 -c "{server}" >/dev/null 2>&1 & sleep 0.5; echo started'
    probe = f"timeout 3 bash -c 'echo > /dev/tcp/alex.proj/{PORT}' 2>/dev/null && echo open || echo closed"
    assert (await h.ssh("alex", listen)).stdout.strip() == "started"
    assert (await h.ssh("anna", "getent hosts alex.proj")).stdout.split()[:1] == ["10.235.0.3"]
    assert (await h.ssh("anna", probe)).stdout.strip() == "open"

    restart = {k: b[k] for k in ("allocation_id", "username", "gpu_indices", "authorized_keys", "runtime", "overlay")}
    r = await h.task("restart", {**restart, "project_id": project})
    assert r["network"]["address"] == "10.235.0.3"
    assert (await h.ssh("alex", "getent hosts anna.proj")).stdout.split()[:1] == ["10.235.0.2"]  # names rewritten
    assert (await h.ssh("alex", listen)).stdout.strip() == "started"
    assert (await h.ssh("anna", probe)).stdout.strip() == "open"

    # A heartbeat's answer with a member more (on another host): the names reach every member here.
    carl = {**names, "carl.proj": "10.235.0.9"}
    await h.agent.apply_overlays([OverlaySpec.model_validate({**a["overlay"], "project_id": project, "names": carl})])
    assert (await h.ssh("anna", "getent hosts carl.proj")).stdout.split()[:1] == ["10.235.0.9"]

    for p in (a, b):
        await h.task("release", {"allocation_id": p["allocation_id"], "username": p["username"]})
    assert sh("ip", "link", "show", overlay.vxlan_name(vni), check=False) == ""
    assert overlay.vxlan_name(vni) not in sh("ebtables", "-L")
    if not await overlay.segments():  # the host's last segment: its underlay guard went with it
        assert overlay.GUARD not in sh("iptables", "-S")
