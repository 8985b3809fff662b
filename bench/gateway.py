"""Gateway overhead benchmark: identity `GET /me` direct, through the Python gateway, and through nginx.

Setup (self-contained): identity and the gateway as processes (`gpuaas.devstack.Stack`, free ports, its own
embedded Postgres and Tansu), the seeded admin's token, and an nginx (the Debian package, `/usr/sbin/nginx`)
started by this script from a config it writes: `location /api/identity/ { proxy_pass http://identity/; }`
with an upstream keepalive pool, one worker process (the gateway is one process too), no access log. nginx
is the anchor: a standard proxy doing the same hop in the same run.

The gateway's rate limit is raised out of the way (its bucket code still runs); everything else is as deployed.

Measured per target, in `--rounds` interleaved rounds (direct, gateway, nginx, direct, ...) so that noise
from other work on the machine spreads over all three:
  sequential   one keep-alive connection, `--requests` requests back to back: p50 / p99 latency
  concurrent   `--clients` keep-alive connections for `--duration` s each: requests/s (and p50 / p99)
The load generator is a minimal asyncio HTTP/1.1 client (pre-built request bytes, Content-Length or chunked
bodies) so that it costs far less than the servers it measures. Printed: the figures, the ratios to direct,
and whether the goals hold (gateway p99 <= 1.3x direct, throughput >= 0.9x direct); written to
bench/results/gateway.json.

`--profile` also runs a second gateway under cProfile (same settings, its own port), drives `--requests`
sequential requests through it and prints the top functions (written to bench/results/gateway_profile.txt).

    uv run python bench/gateway.py [--rounds 3] [--requests 1000] [--clients 16] [--duration 8] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import pstats
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from gpuaas.devstack.stack import Stack, StackConfig
from gpuaas.devstack.testing import remove_root, temp_root

RESULTS = Path(__file__).parent / "results"
TARGETS = ("direct", "gateway", "nginx")
GOAL_P99 = 1.3
GOAL_RPS = 0.9

NGINX_CONF = """\
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
daemon off;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream identity {{
        server {upstream};
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port};
        location /api/identity/ {{
            proxy_pass http://identity/;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto $scheme;
            proxy_set_header X-Forwarded-Host $host;
        }}
    }}
}}
"""


# The gateway as `python -m gpuaas.gateway serve` runs it, profiled on CPU time (not wall time: other work on the
# machine would show up as time in whatever was running) from SIGUSR1 until it exits.
PROFILED_GATEWAY = """
import cProfile, signal, sys, time
from gpuaas.gateway.__main__ import main
prof = cProfile.Profile(time.process_time)
signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
try:
    main(["serve"])
finally:
    prof.disable()
    prof.dump_stats(sys.argv[1])
"""


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Conn:
    """One keep-alive HTTP/1.1 connection sending the same request over and over."""

    def __init__(self, host: str, port: int, request: bytes) -> None:
        self.host, self.port, self.request = host, port, request
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass

    async def once(self) -> int:
        """Send the request, read the whole response; returns the status code."""
        assert self.reader is not None and self.writer is not None
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = None
        chunked = False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
        if chunked:
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        elif length:
            await self.reader.readexactly(length)
        return status


def build_request(path: str, port: int, token: str) -> bytes:
    return (
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n"
        "Accept: application/json\r\nUser-Agent: gpuaas-bench\r\n\r\n"
    ).encode()


async def sequential(port: int, request: bytes, n: int) -> dict:
    conn = Conn("127.0.0.1", port, request)
    await conn.open()
    lat: list[float] = []
    bad = 0
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            status = await conn.once()
            lat.append(time.perf_counter() - t0)
            bad += status != 200
    finally:
        await conn.close()
    return {"lat": lat, "errors": bad}


async def concurrent(port: int, request: bytes, clients: int, duration: float) -> dict:
    conns = [Conn("127.0.0.1", port, request) for _ in range(clients)]
    await asyncio.gather(*(c.open() for c in conns))
    lat: list[float] = []
    bad = 0

    async def worker(c: Conn, deadline: float) -> int:
        nonlocal bad
        n = 0
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            status = await c.once()
            lat.append(time.perf_counter() - t0)
            bad += status != 200
            n += 1
        return n

    started = time.perf_counter()
    try:
        counts = await asyncio.gather(*(worker(c, started + duration) for c in conns))
    finally:
        elapsed = time.perf_counter() - started
        await asyncio.gather(*(c.close() for c in conns))
    return {"requests": sum(counts), "elapsed": elapsed, "lat": lat, "errors": bad}


def cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) of a process and its children (nginx: its worker)."""
    if not pid:
        return float("nan")
    p = psutil.Process(pid)
    total = 0.0
    for q in [p, *p.children(recursive=True)]:
        t = q.cpu_times()
        total += t.user + t.system
    return total


def start_nginx(workdir: Path, upstream: str, port: int) -> subprocess.Popen:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        raise SystemExit("nginx is not installed (Debian: apt-get install nginx-light; `make deps-apt` does it)")
    workdir.mkdir(parents=True, exist_ok=True)
    conf = workdir / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=workdir, upstream=upstream, port=port))
    proc = subprocess.Popen(
        [nginx, "-p", str(workdir), "-c", str(conf)],
        stdout=subprocess.DEVNULL,
        stderr=open(workdir / "stderr.log", "wb"),  # noqa: SIM115 - lives as long as nginx
        start_new_session=True,
    )
    return proc


async def wait_http(url: str, token: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as c:
        while True:
            try:
                r = await c.get(url, headers={"Authorization": f"Bearer {token}"})
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} did not answer 200 in {timeout_s}s")
            await asyncio.sleep(0.2)


async def login(stack: Stack) -> str:
    email, password = stack.admin_login
    async with httpx.AsyncClient(base_url=stack.service_url("identity"), timeout=30) as c:
        r = await c.post("/auth/token", data={"grant_type": "password", "username": email, "password": password})
        r.raise_for_status()
        return r.json()["access_token"]


def summarize(target: str, seq: list[dict], conc: list[dict]) -> dict:
    lat = [x for r in seq for x in r["lat"]]
    n = sum(r["requests"] for r in conc)
    cpu_ms = {
        proc: round(sum(r["cpu_s"][proc] for r in conc) / max(n, 1) * 1000, 3)
        for proc in ("identity", target)
        if proc != "direct"
    }
    clat = [x for r in conc for x in r["lat"]]
    rps = [r["requests"] / r["elapsed"] for r in conc]
    return {
        "sequential": {
            "requests": len(lat),
            "errors": sum(r["errors"] for r in seq),
            "p50_ms": round(pct(lat, 50) * 1000, 2),
            "p99_ms": round(pct(lat, 99) * 1000, 2),
        },
        "concurrent": {
            "requests": sum(r["requests"] for r in conc),
            "errors": sum(r["errors"] for r in conc),
            "rps": round(sum(r["requests"] for r in conc) / sum(r["elapsed"] for r in conc), 1),
            "rps_per_round": [round(x, 1) for x in rps],
            "p50_ms": round(pct(clat, 50) * 1000, 2),
            "p99_ms": round(pct(clat, 99) * 1000, 2),
            # CPU time each server process spent per request during the concurrent phase (noise-robust).
            "cpu_ms_per_request": cpu_ms,
        },
    }


def _spawn_profiled(env: dict[str, str], prof: Path, log_path: Path) -> tuple[subprocess.Popen, io.BufferedWriter]:
    log = open(log_path, "ab")  # noqa: SIM115 - closed once the process has exited
    proc = subprocess.Popen(
        [sys.executable, "-c", PROFILED_GATEWAY, str(prof)], env=env, stdout=log, stderr=log, start_new_session=True
    )
    return proc, log


async def profile_gateway(stack: Stack, token: str, requests: int, out: Path) -> str:
    """A second gateway under cProfile, same environment as the stack's, driven sequentially."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "GPUAAS_DATABASE_URL"}
    env.update(stack.env_for("gateway"))
    env.update({"GPUAAS_GATEWAY_PORT": str(port), "PYTHONUNBUFFERED": "1"})
    prof = stack.root / "gateway.prof"  # removed with the stack's directory; the text report is kept
    proc, log = await asyncio.to_thread(_spawn_profiled, env, prof, stack.logs_dir / "gateway-profiled.log")
    try:
        await wait_http(f"http://127.0.0.1:{port}/api/identity/me", token)
        request = build_request("/api/identity/me", port, token)
        await sequential(port, request, 200)  # warm-up
        proc.send_signal(signal.SIGUSR1)  # start profiling after start-up and warm-up
        await asyncio.sleep(0.5)
        await sequential(port, request, requests)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        log.close()
    buf = io.StringIO()
    stats = pstats.Stats(str(prof), stream=buf)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(45)
    text = buf.getvalue()
    out.write_text(text)
    return text


async def main(args: argparse.Namespace) -> dict:
    root = temp_root("gpuaas-bench-gateway-")
    limits = {"GPUAAS_GATEWAY_RATE_LIMIT_PER_S": "1000000", "GPUAAS_GATEWAY_RATE_LIMIT_BURST": "1000000"}
    stack = Stack(
        StackConfig.from_env(root=root, free_ports=True, services=("identity",), agents=(), env={"gateway": limits})
    )
    t0 = time.monotonic()
    await asyncio.to_thread(stack.start)
    print(f"stack ready in {time.monotonic() - t0:.1f}s", flush=True)
    nginx = None
    nginx_dir = Path(tempfile.mkdtemp(prefix="gpuaas-bench-nginx-"))
    try:
        token = await login(stack)
        identity = stack.service_url("identity").removeprefix("http://")
        nginx_port = free_port()
        nginx = start_nginx(nginx_dir, identity, nginx_port)
        ports = {
            "direct": (stack.ports["identity"], "/me"),
            "gateway": (stack.ports["gateway"], "/api/identity/me"),
            "nginx": (nginx_port, "/api/identity/me"),
        }
        requests = {t: build_request(path, port, token) for t, (port, path) in ports.items()}
        for t, (port, path) in ports.items():
            await wait_http(f"http://127.0.0.1:{port}{path}", token)
            await sequential(port, requests[t], 200)  # warm-up: imports, pools, caches
        pids = {"identity": stack.pid("identity"), "gateway": stack.pid("gateway"), "nginx": nginx.pid}
        seq: dict[str, list[dict]] = {t: [] for t in TARGETS}
        conc: dict[str, list[dict]] = {t: [] for t in TARGETS}
        for rnd in range(args.rounds):
            for t in TARGETS:
                port = ports[t][0]
                seq[t].append(await sequential(port, requests[t], args.requests))
                before = {n: cpu_s(p) for n, p in pids.items()}
                conc[t].append(await concurrent(port, requests[t], args.clients, args.duration))
                conc[t][-1]["cpu_s"] = {n: cpu_s(p) - before[n] for n, p in pids.items()}
                print(
                    f"round {rnd + 1} {t:8} seq p50 {pct(seq[t][-1]['lat'], 50) * 1000:6.2f} ms "
                    f"p99 {pct(seq[t][-1]['lat'], 99) * 1000:6.2f} ms | {args.clients} clients "
                    f"{conc[t][-1]['requests'] / conc[t][-1]['elapsed']:7.1f} req/s "
                    f"(load avg {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
        profile = None
        if args.profile:
            profile = await profile_gateway(stack, token, args.requests, RESULTS / "gateway_profile.txt")
    finally:
        if nginx is not None and nginx.poll() is None:
            nginx.send_signal(signal.SIGQUIT)
            try:
                nginx.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(nginx.pid, signal.SIGKILL)
        shutil.rmtree(nginx_dir, ignore_errors=True)
        await asyncio.to_thread(stack.stop)
        remove_root(root)
    figures = {t: summarize(t, seq[t], conc[t]) for t in TARGETS}
    ratios = {}
    for t in ("gateway", "nginx"):
        d, x = figures["direct"], figures[t]
        ratios[t] = {
            "seq_p50": round(x["sequential"]["p50_ms"] / d["sequential"]["p50_ms"], 2),
            "seq_p99": round(x["sequential"]["p99_ms"] / d["sequential"]["p99_ms"], 2),
            "rps": round(x["concurrent"]["rps"] / d["concurrent"]["rps"], 2),
        }
    goals = {
        "gateway_p99_le_1.3x_direct": ratios["gateway"]["seq_p99"] <= GOAL_P99,
        "gateway_rps_ge_0.9x_direct": ratios["gateway"]["rps"] >= GOAL_RPS,
    }
    result = {
        "request": "GET identity /me (bearer token)",
        "rounds": args.rounds,
        "sequential_requests_per_round": args.requests,
        "clients": args.clients,
        "duration_s_per_round": args.duration,
        "cpus": os.cpu_count(),
        "load_avg_1m_after": round(os.getloadavg()[0], 2),
        "targets": figures,
        "ratio_to_direct": ratios,
        "goals": goals,
    }
    if profile is not None:
        result["profile"] = str(RESULTS / "gateway_profile.txt")
    return result


def report(r: dict) -> None:
    print(f"\nGET /me, {r['rounds']} rounds: {r['sequential_requests_per_round']} sequential + {r['clients']} clients")
    print(f"{'target':9} {'seq p50':>9} {'seq p99':>9} {'req/s':>9} {'conc p50':>9} {'conc p99':>9} {'errors':>7}")
    for t, f in r["targets"].items():
        s, c = f["sequential"], f["concurrent"]
        print(
            f"{t:9} {s['p50_ms']:>9} {s['p99_ms']:>9} {c['rps']:>9} {c['p50_ms']:>9} {c['p99_ms']:>9} "
            f"{s['errors'] + c['errors']:>7}  CPU ms/request: {c['cpu_ms_per_request']}"
        )
    for t, x in r["ratio_to_direct"].items():
        print(f"{t:9} / direct: seq p50 {x['seq_p50']}x  seq p99 {x['seq_p99']}x  throughput {x['rps']}x")
    for goal, ok in r["goals"].items():
        print(f"goal {goal}: {'met' if ok else 'NOT met'}")
    print(f"(load average after the run: {r['load_avg_1m_after']} on {r['cpus']} CPUs)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--output", default="gateway.json", help="file name under bench/results/")
    args = ap.parse_args()
    RESULTS.mkdir(exist_ok=True)
    res = asyncio.run(main(args))
    report(res)
    (RESULTS / args.output).write_text(json.dumps(res, indent=2) + "\n")
