"""The gateway's own endpoints: `/` (the web console, else a placeholder page), `/healthz`, `/readyz`, `/metrics`,
`/openapi.json` (aggregated) and `/docs` (Swagger UI over it)."""

from __future__ import annotations

import asyncio
import html
from typing import Any

import httpx
from fastapi import APIRouter, Request, Response
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpuaas.gateway import console
from gpuaas.gateway.runtime import Gateway, GatewayRuntime
from gpuaas.gateway.upstreams import Upstream

router = APIRouter(include_in_schema=False)

INDEX = """<!doctype html>
<html lang="en">
<head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>GPUaaS</title>
<style>body{{font-family:system-ui,sans-serif;max-width:40rem;margin:4rem auto;padding:0 1rem;line-height:1.5}}</style>
</head>
<body>
<h1>GPUaaS</h1>
<p>The web console is not available yet: it is coming soon. This gateway currently serves the API only.</p>
<ul>
<li><a href="/docs">API documentation</a> (Swagger UI)</li>
<li><a href="/openapi.json">OpenAPI document</a></li>
<li><a href="/readyz">Service readiness</a></li>
</ul>
<p>Services: {services}</p>
</body>
</html>
"""


@router.get("/")
async def index(request: Request, rt: Gateway) -> Response:
    if (page := console.index_response(request)) is not None:
        return page
    services = ", ".join(f"<code>/api/{html.escape(s)}/</code>" for s in rt.upstreams)
    return HTMLResponse(INDEX.format(services=services))


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(rt: Gateway) -> JSONResponse:
    names = list(rt.upstreams.values())
    results = await asyncio.gather(*(_probe(rt, u) for u in names))
    upstreams = {u.segment: r for u, r in zip(names, results, strict=True)}
    ready = all(r["ready"] for r in results)
    return JSONResponse({"ready": ready, "upstreams": upstreams}, status_code=200 if ready else 503)


async def _probe(rt: GatewayRuntime, upstream: Upstream) -> dict[str, Any]:
    try:
        resp = await rt.client.get(f"{upstream.base_url}/readyz", timeout=rt.settings.readiness_timeout_s)
    except httpx.TimeoutException:
        return {"ready": False, "status": None, "error": "timed out"}
    except httpx.HTTPError as exc:
        return {"ready": False, "status": None, "error": f"unreachable ({exc.__class__.__name__})"}
    return {"ready": resp.status_code == 200, "status": resp.status_code}


@router.get("/metrics")
async def metrics(rt: Gateway) -> Response:
    return Response(generate_latest(rt.metrics.service.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/openapi.json")
async def openapi(rt: Gateway) -> JSONResponse:
    return JSONResponse(await rt.docs.document())


@router.get("/docs")
async def docs() -> HTMLResponse:
    # Swagger UI's assets come from its CDN; the document itself is ours.
    return get_swagger_ui_html(openapi_url="/openapi.json", title="GPUaaS API")
