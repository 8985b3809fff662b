"""`gpuaas-controller run module:Controller`: run a controller as a service.

    GPUAAS_URL=https://gpuaas.example.com GPUAAS_CLIENT_ID=... GPUAAS_CLIENT_SECRET=... \\
        gpuaas-controller run echo_controller:EchoController --app-slug echo [--port 9464]

- authenticates as the project service account (client_credentials, refreshed after a 401);
- SIGTERM / SIGINT stop it gracefully: no new claims, the operation in hand is finished and reported;
- works on up to `--concurrency` operations at once (never two on one member);
- logs one line per event (`--log-format json` for JSON lines); idle polls are DEBUG, so INFO shows claims,
  outcomes, retries, deferrals, errors, and each instance's reconcile result at most once a minute;
- serves `GET /healthz` (200 while the loop runs and the platform answered within `--stale-s`, else 503) and
  `GET /metrics` (Prometheus text) on `--port` (0: not served).

Every option has an environment variable: GPUAAS_APP_SLUG, GPUAAS_LEASE_S, GPUAAS_POLL_S,
GPUAAS_RECONCILE_EVERY_S, GPUAAS_CONCURRENCY, GPUAAS_HEALTH_PORT, GPUAAS_LOG_LEVEL, GPUAAS_LOG_FORMAT,
GPUAAS_CONTROLLER_HOLDER.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import signal
import sys
import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpuaas.sdk.client import Client
from gpuaas.sdk.controller.handlers import Controller
from gpuaas.sdk.controller.loop import ReconcileLoop

log = logging.getLogger("gpuaas.sdk.controller.runner")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line)


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter() if fmt == "json" else logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s")
    )
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    for noisy in ("asyncssh", "httpx", "httpcore"):  # one line per request / packet: only when debugging them
        logging.getLogger(noisy).setLevel(logging.WARNING)


def load_controller(target: str) -> Controller:
    """`package.module:ClassName` → an instance (built with no arguments, or by its `from_env()`)."""
    module_name, _, attr = target.partition(":")
    if not attr:
        raise SystemExit(f"expected module:Controller, got {target!r}")
    cls = getattr(importlib.import_module(module_name), attr)
    controller = cls.from_env() if hasattr(cls, "from_env") else cls()
    if not isinstance(controller, Controller):
        raise SystemExit(f"{target} is not a gpuaas.sdk.controller.Controller")
    return controller


async def serve_health(loop: ReconcileLoop, port: int, stale_s: float) -> asyncio.Server:
    """A minimal HTTP/1.0 server: /healthz and /metrics (no framework: one dependency less for controllers)."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = (await asyncio.wait_for(reader.readline(), 5)).decode(errors="replace").split()
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass
            path = request[1] if len(request) > 1 else "/"
            if path == "/metrics":
                status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, generate_latest(loop.metrics.registry)
            elif path == "/healthz":
                fresh = time.monotonic() - loop.last_contact < stale_s
                ok = loop.running and fresh
                status = "200 OK" if ok else "503 Service Unavailable"
                ctype = "application/json"
                body = json.dumps({"running": loop.running, "platform_reachable": fresh}).encode()
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"not found\n"
            head = f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n"
            writer.write(head.encode() + body)
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(answer, "0.0.0.0", port)  # a probe port, like any exporter


async def run(args: argparse.Namespace) -> None:
    controller = load_controller(args.target)
    client = Client(args.url, timeout_s=60)
    client.use_client_credentials(os.environ["GPUAAS_CLIENT_ID"], os.environ["GPUAAS_CLIENT_SECRET"])
    loop = ReconcileLoop(
        client,
        app_slug=args.app_slug,
        controller=controller,
        lease_s=args.lease_s,
        poll_interval_s=args.poll_s,
        reconcile_every_s=args.reconcile_every_s,
        holder=os.environ.get("GPUAAS_CONTROLLER_HOLDER"),
        max_concurrent_operations=args.concurrency,
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, loop.stop)
    server = await serve_health(loop, args.port, args.stale_s) if args.port else None
    log.info(
        "controller_started app=%s target=%s holder=%s port=%s", args.app_slug, args.target, loop.holder, args.port
    )
    try:
        await loop.run()
    finally:
        if server is not None:
            server.close()
        await client.aclose()
        log.info("controller_stopped app=%s", args.app_slug)


def parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="gpuaas-controller", description="Run a GPUaaS app controller.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run module:Controller until SIGTERM/SIGINT")
    r.add_argument("target", help="package.module:ControllerClass")
    r.add_argument("--url", default=env("GPUAAS_URL", "http://127.0.0.1:8000"))
    r.add_argument("--app-slug", default=env("GPUAAS_APP_SLUG"), required=env("GPUAAS_APP_SLUG") is None)
    r.add_argument("--lease-s", type=int, default=int(env("GPUAAS_LEASE_S", "60")))
    r.add_argument("--poll-s", type=float, default=float(env("GPUAAS_POLL_S", "1.0")))
    r.add_argument("--reconcile-every-s", type=float, default=float(env("GPUAAS_RECONCILE_EVERY_S", "0")) or None)
    r.add_argument(
        "--concurrency",
        type=int,
        default=int(env("GPUAAS_CONCURRENCY", "4")),
        help="operations worked on at once (never two on one member)",
    )
    r.add_argument("--port", type=int, default=int(env("GPUAAS_HEALTH_PORT", "9464")))
    r.add_argument("--stale-s", type=float, default=60.0, help="/healthz fails when the platform is silent this long")
    r.add_argument("--log-level", default=env("GPUAAS_LOG_LEVEL", "INFO"))
    r.add_argument("--log-format", choices=("text", "json"), default=env("GPUAAS_LOG_FORMAT", "text"))
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
