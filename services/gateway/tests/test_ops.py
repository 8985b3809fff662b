"""The gateway's own endpoints, and `python -m gpuaas.gateway serve` as a real process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

import httpx

from gpuaas.gateway.settings import DEFAULT_UPSTREAMS, Settings


async def test_healthz_and_index(gateway):
    async with httpx.AsyncClient(base_url=gateway) as client:
        health = await client.get("/healthz")
        index = await client.get("/")
    assert health.json() == {"status": "ok"}
    assert index.headers["content-type"].startswith("text/html")
    assert "coming soon" in index.text
    assert 'href="/docs"' in index.text


async def test_readyz_lists_each_upstream(stack):
    ready_gateway = await stack.gateway(upstreams={"identity": stack.identity_url, "catalog": stack.catalog_url})
    gateway = await stack.gateway()  # also routes billing, which is down
    async with httpx.AsyncClient() as client:
        ready = await client.get(f"{ready_gateway}/readyz")
        not_ready = await client.get(f"{gateway}/readyz")
    assert ready.status_code == 200
    assert ready.json() == {
        "ready": True,
        "upstreams": {"identity": {"ready": True, "status": 200}, "catalog": {"ready": True, "status": 200}},
    }
    assert not_ready.status_code == 503
    body = not_ready.json()
    assert body["ready"] is False
    assert body["upstreams"]["catalog"]["ready"] is True
    assert body["upstreams"]["billing"]["ready"] is False
    assert body["upstreams"]["billing"]["status"] is None


async def test_metrics_count_upstream_requests_by_service_and_status(stack, gateway):
    async with httpx.AsyncClient(base_url=gateway) as client:
        await client.get("/api/catalog/echo", headers=stack.bearer())
        await client.get("/api/catalog/teapot", headers=stack.bearer())
        await client.get("/api/catalog/teapot", headers=stack.bearer())
        await client.get("/api/catalog/echo")  # refused at the edge: not counted upstream
        text = (await client.get("/metrics")).text
    assert 'gpuaas_upstream_requests_total{service="gateway",status="200",upstream="catalog"} 1.0' in text
    assert 'gpuaas_upstream_requests_total{service="gateway",status="418",upstream="catalog"} 2.0' in text
    assert 'gpuaas_auth_rejected_total{code="missing_token",service="gateway"} 1.0' in text
    buckets = [line for line in text.splitlines() if line.startswith("gpuaas_http_request_duration_seconds_bucket{")]
    assert buckets and all('service="gateway"' in line for line in buckets)


def test_settings_read_upstreams_from_env_as_json(monkeypatch):
    monkeypatch.setenv("GPUAAS_GATEWAY_UPSTREAMS", json.dumps({"identity": "http://id:9/", "app_runtime": "http://ar"}))
    monkeypatch.setenv("GPUAAS_GATEWAY_RATE_LIMIT_BURST", "7")
    settings = Settings()
    assert settings.upstreams == {"identity": "http://id:9", "app_runtime": "http://ar"}
    assert settings.rate_limit_burst == 7
    assert settings.port == 8000
    monkeypatch.delenv("GPUAAS_GATEWAY_UPSTREAMS")
    assert Settings().upstreams == DEFAULT_UPSTREAMS


async def test_serve_command_runs_the_gateway(stack, free_port):
    port = free_port()
    env = os.environ | {
        "GPUAAS_GATEWAY_HOST": "127.0.0.1",
        "GPUAAS_GATEWAY_PORT": str(port),
        "GPUAAS_GATEWAY_UPSTREAMS": json.dumps({"identity": stack.identity_url}),
        "GPUAAS_JWKS_URL": stack.jwks_url,
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpuaas.gateway", "serve", env=env, stderr=asyncio.subprocess.PIPE
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            deadline = time.monotonic() + 60  # a Python start-up on a loaded 2-core machine (seen >20 s)
            while True:
                try:
                    health = await client.get("/healthz")
                    break
                except httpx.TransportError:
                    assert proc.returncode is None, "the gateway process exited"
                    assert time.monotonic() < deadline, "the gateway did not start"
                    await asyncio.sleep(0.1)
            login = await client.get("/api/identity/auth/login", headers={"X-Correlation-ID": "from-test-1"})
        assert health.json() == {"status": "ok"}
        assert login.json()["public"] is True
    finally:
        proc.send_signal(signal.SIGTERM)
        _, raw = await asyncio.wait_for(proc.communicate(), 15)
        stderr = raw.decode()
    assert proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a graceful stop
    logs = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    assert any(entry.get("event") == "Application shutdown complete." for entry in logs)
    proxied = [entry for entry in logs if entry.get("event") == "proxied"]
    assert proxied and proxied[0]["correlation_id"] == "from-test-1"
    assert proxied[0]["service"] == "identity" and proxied[0]["status"] == 200
    assert not any(entry.get("logger") == "httpx" for entry in logs)  # no second, URL-bearing line
