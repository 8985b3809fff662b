"""The web console hook: a built console folder is served at `/` (index + hashed assets)."""

from __future__ import annotations

from pathlib import Path

import httpx

from gpuaas.gateway.console import find_console


async def test_serves_a_console_build(stack, tmp_path: Path):
    (tmp_path / "assets").mkdir()
    (tmp_path / "index.html").write_text('<!doctype html><title>GPUaaS console</title><script src="/assets/a.js">')
    (tmp_path / "assets" / "a-1234.js").write_text("console.log('hi')")
    gateway = await stack.gateway(console_dir=str(tmp_path))
    async with httpx.AsyncClient(base_url=gateway) as client:
        index = await client.get("/")
        asset = await client.get("/assets/a-1234.js")
        missing = await client.get("/assets/nope.js")
        api = await client.get("/api/nowhere/x")
    assert index.status_code == 200 and "GPUaaS console" in index.text
    assert index.headers["cache-control"] == "no-cache"
    assert "default-src 'self'" in index.headers["content-security-policy"]
    assert asset.status_code == 200 and asset.text == "console.log('hi')"
    assert "immutable" in asset.headers["cache-control"]
    assert missing.status_code == 404
    assert api.status_code in (401, 404)  # the API routes are untouched


def test_find_console(tmp_path: Path):
    assert find_console("") is None
    assert find_console(str(tmp_path)) is None  # no index.html: no console
    (tmp_path / "index.html").write_text("x")
    assert find_console(str(tmp_path)) == tmp_path.resolve()
