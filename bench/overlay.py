"""Overlay cost (issue 27): TCP throughput and round-trip latency between two members of a project on different
simulated hosts (through the agent's VXLAN segment over a test underlay) against two namespaces joined directly
by a veth pair, in the same run, interleaved.

Setup (root; everything in network namespaces this bench creates and deletes, nothing leaves the machine):
an underlay bridge in a namespace of its own, hosts A and B in namespaces on it (198.18.78.1/.2), each running
the node agent's real `overlay.join` for one project (bridge + VXLAN port + static FDB), a member namespace on
each host's project bridge (the overlay's MTU, MAC from the address plan); and two more namespaces joined by a
plain veth (MTU 1500) as the baseline. No iperf3 in the project's Debian packages: a Python socket test
(one TCP stream, 64 KiB writes, for --seconds; ping-pong of 64-byte messages on one connection for latency).

    sudo uv run python bench/overlay.py [--seconds 3] [--rounds 3] [--pings 2000]

Prints both and the ratios; writes bench/results/overlay.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from gpuaas.node_agent import overlay

VNI, SUBNET = 4201, "10.233.0.0/24"
PORT = 18090
SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(4); print("ready", flush=True)
while True:
    c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    mode = c.recv(1)
    if mode == b"t":
        while c.recv(1 << 20):
            pass
        c.sendall(b"k")
    else:
        while (m := c.recv(64)):
            c.sendall(m)
    c.close()
"""
CLIENT = """
import json, socket, sys, time
host, port, seconds, pings = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
c = socket.create_connection((host, port)); c.sendall(b"t"); buf = b"x" * 65536; sent = 0
t0 = time.perf_counter()
while time.perf_counter() - t0 < seconds:
    c.sendall(buf); sent += len(buf)
c.shutdown(socket.SHUT_WR); c.recv(1); elapsed = time.perf_counter() - t0; c.close()
c = socket.create_connection((host, port)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); c.sendall(b"p")
msg, rtts = b"y" * 64, []
for _ in range(pings):
    t = time.perf_counter(); c.sendall(msg); got = 0
    while got < 64:
        got += len(c.recv(64 - got))
    rtts.append(time.perf_counter() - t)
c.close()
print(json.dumps({"gbit_s": sent * 8 / elapsed / 1e9, "rtts": rtts}))
"""


def sh(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout


class Topology:
    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:4]
        self.ul, self.ha, self.hb = f"gpuaas-bul-{tag}", f"gpuaas-bha-{tag}", f"gpuaas-bhb-{tag}"
        self.ma, self.mb, self.da, self.db = (f"gpuaas-b{x}-{tag}" for x in ("ma", "mb", "da", "db"))
        self.namespaces = [self.ul, self.ha, self.hb, self.ma, self.mb, self.da, self.db]
        self.servers: list[subprocess.Popen[str]] = []

    def build(self) -> None:
        for ns in self.namespaces:
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", self.ul, "link", "add", "ul", "type", "bridge")
        sh("ip", "-n", self.ul, "link", "set", "ul", "up")
        seg_a = overlay.segment(VNI, SUBNET, "198.18.78.1", [("198.18.78.2", ["10.233.0.20"])])
        seg_b = overlay.segment(VNI, SUBNET, "198.18.78.2", [("198.18.78.1", ["10.233.0.10"])])
        sides = (("pa", self.ha, seg_a, self.ma, "10.233.0.10"), ("pb", self.hb, seg_b, self.mb, "10.233.0.20"))
        for port, host, seg, member, address in sides:
            sh("ip", "-n", host, "link", "add", "ul0", "type", "veth", "peer", "name", port, "netns", self.ul)
            sh("ip", "-n", self.ul, "link", "set", port, "master", "ul", "up")
            sh("ip", "-n", host, "addr", "add", f"{seg.local}/24", "dev", "ul0")
            sh("ip", "-n", host, "link", "set", "ul0", "up")
            sh("ip", "-n", host, "link", "add", "gpb", "type", "bridge")
            sh("ip", "-n", host, "addr", "add", f"{seg.gateway}/24", "dev", "gpb")
            sh("ip", "-n", host, "link", "set", "gpb", "up")
            peers = [[str(p.underlay), [str(a) for a in p.addresses]] for p in seg.peers]
            sh(
                "ip",
                "netns",
                "exec",
                host,
                sys.executable,
                "-c",
                JOIN,
                "gpb",
                json.dumps([VNI, SUBNET, str(seg.local), peers]),
            )
            mtu = str(overlay.member_mtu())
            sh(
                "ip",
                "-n",
                host,
                "link",
                "add",
                "m0",
                "mtu",
                mtu,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                member,
            )
            sh("ip", "-n", host, "link", "set", "m0", "master", "gpb", "up")
            sh("ip", "-n", member, "link", "set", "eth0", "address", overlay.member_mac(address), "mtu", mtu, "up")
            sh("ip", "-n", member, "addr", "add", f"{address}/24", "dev", "eth0")
        sh("ip", "-n", self.da, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", self.db)
        for ns, address in ((self.da, "10.234.0.1"), (self.db, "10.234.0.2")):
            sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
        for ns in (self.mb, self.db):
            server = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-c", SERVER, str(PORT)], stdout=subprocess.PIPE, text=True
            )
            self.servers.append(server)
            assert server.stdout is not None and server.stdout.readline().strip() == "ready"

    def measure(self, ns: str, target: str, seconds: float, pings: int) -> tuple[float, list[float]]:
        """(Gbit/s, round-trip times in s) from `ns` to the server at `target`."""
        out = json.loads(
            sh("ip", "netns", "exec", ns, sys.executable, "-c", CLIENT, target, str(PORT), str(seconds), str(pings))
        )
        return float(out["gbit_s"]), [float(x) for x in out["rtts"]]

    def close(self) -> None:
        for server in self.servers:
            server.kill()
            server.wait()
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


# The agent's own code, run inside a simulated host's namespace.
JOIN = """
import asyncio, json, sys
from gpuaas.node_agent import overlay
vni, subnet, local, peers = json.loads(sys.argv[2])
asyncio.run(overlay.join(sys.argv[1], overlay.segment(vni, subnet, local, [(u, a) for u, a in peers])))
"""


def summary(runs: list[tuple[float, list[float]]]) -> dict[str, float]:
    rtts = sorted(r for _, run in runs for r in run)
    return {
        "gbit_s_median": statistics.median(gbit for gbit, _ in runs),
        "rtt_us_p50": rtts[len(rtts) // 2] * 1e6,
        "rtt_us_p99": rtts[int(len(rtts) * 0.99)] * 1e6,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description="overlay vs direct veth: throughput and latency")
    parser.add_argument("--seconds", type=float, default=3.0, help="throughput phase per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pings", type=int, default=2000, help="round trips per round")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root (network namespaces, bridges, VXLAN)", file=sys.stderr)
        return 2
    topo = Topology()
    results: dict[str, list[tuple[float, list[float]]]] = {"overlay": [], "veth": []}
    try:
        topo.build()
        for _ in range(args.rounds):  # interleaved: both see the same machine load
            results["overlay"].append(topo.measure(topo.ma, "10.233.0.20", args.seconds, args.pings))
            results["veth"].append(topo.measure(topo.da, "10.234.0.2", args.seconds, args.pings))
    finally:
        topo.close()
    figures = {name: summary(runs) for name, runs in results.items()}
    ratio = {
        "throughput_overlay_over_veth": figures["overlay"]["gbit_s_median"] / figures["veth"]["gbit_s_median"],
        "rtt_p50_overlay_over_veth": figures["overlay"]["rtt_us_p50"] / figures["veth"]["rtt_us_p50"],
    }
    setup = {"rounds": args.rounds, "seconds": args.seconds, "pings": args.pings, "loadavg_1m": os.getloadavg()[0]}
    for name in ("overlay", "veth"):
        f = figures[name]
        gbit, p50, p99 = f["gbit_s_median"], f["rtt_us_p50"], f["rtt_us_p99"]
        print(f"{name:8s} {gbit:7.2f} Gbit/s   rtt p50 {p50:6.1f} us   p99 {p99:7.1f} us")
    t, r = ratio["throughput_overlay_over_veth"], ratio["rtt_p50_overlay_over_veth"]
    print(f"overlay/veth: throughput x{t:.2f}, rtt p50 x{r:.2f}")
    record = {**figures, "ratio": ratio, "setup": setup, "at": time.time()}
    out = Path(__file__).parent / "results" / "overlay.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
