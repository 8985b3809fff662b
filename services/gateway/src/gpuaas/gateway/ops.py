"""The gateway's own endpoints: `/` (the web console, else a placeholder page), `/healthz`, `/readyz`, `/metrics`,
`/openapi.json` (aggregated) and `/docs` (Swagger UI over it).

Exposure (docs/decisions.md, "Gateway: what its own endpoints show"): `/openapi.json` and `/docs` are public
(the API's description is no secret; every route checks its caller). `/metrics` needs the metrics token when
one is set, else a direct caller from `metrics_networks`. `/docs` runs on the console's origin, where refresh
tokens live: its Swagger UI assets are pinned to one version with Subresource Integrity, so a changed file
on the CDN is not run.
"""

from __future__ import annotations

import asyncio
import hmac
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
from gpuaas.kit.client_address import is_trusted
from gpuaas.kit.errors import problem_response

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
async def metrics(request: Request, rt: Gateway) -> Response:
    if not metrics_allowed(request, rt):
        # 404, as for any other unknown path: nothing tells a scanner the endpoint is there.
        return problem_response(404, "not_found", "Not found", "Not Found", request.url.path)
    return Response(generate_latest(rt.metrics.service.registry), media_type=CONTENT_TYPE_LATEST)


def metrics_allowed(request: Request, rt: GatewayRuntime) -> bool:
    settings = rt.settings
    if settings.metrics_token is not None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        expected = settings.metrics_token.get_secret_value().encode()
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), expected)
    peer = request.client.host if request.client else None
    return "x-forwarded-for" not in request.headers and is_trusted(peer, settings.metrics_networks)


@router.get("/openapi.json")
async def openapi(rt: Gateway) -> JSONResponse:
    return JSONResponse(await rt.docs.document())


# Swagger UI from its CDN, one pinned version, each file with its Subresource Integrity hash (sha384 of the
# file in the swagger-ui-dist npm package, which the CDN serves as is). To upgrade: change the version and
# recompute both hashes (`openssl dgst -sha384 -binary FILE | base64`).
SWAGGER_UI_VERSION = "5.17.14"
SWAGGER_UI_BASE = f"https://cdn.jsdelivr.net/npm/swagger-ui-dist@{SWAGGER_UI_VERSION}"
SWAGGER_UI_JS_SRI = "sha384-wmyclcVGX/WhUkdkATwhaK1X1JtiNrr2EoYJ+diV3vj4v6OC5yCeSu+yW13SYJep"
SWAGGER_UI_CSS_SRI = "sha384-wxLW6kwyHktdDGr6Pv1zgm/VGJh99lfUbzSn6HNHBENZlCN7W602k9VkGdxuFvPn"


@router.get("/docs")
async def docs() -> HTMLResponse:
    page = get_swagger_ui_html(
        openapi_url="/openapi.json",
        title="GPUaaS API",
        swagger_js_url=f"{SWAGGER_UI_BASE}/swagger-ui-bundle.js",
        swagger_css_url=f"{SWAGGER_UI_BASE}/swagger-ui.css",
        swagger_favicon_url="data:,",
    )
    body = bytes(page.body).decode()
    js, css = f'src="{SWAGGER_UI_BASE}/swagger-ui-bundle.js"', f'href="{SWAGGER_UI_BASE}/swagger-ui.css"'
    if js not in body or css not in body:  # FastAPI changed its template: fail loudly, never serve unpinned
        raise RuntimeError("Swagger UI template changed: cannot add Subresource Integrity")
    body = body.replace(js, f'{js} integrity="{SWAGGER_UI_JS_SRI}" crossorigin="anonymous"')
    body = body.replace(css, f'{css} integrity="{SWAGGER_UI_CSS_SRI}" crossorigin="anonymous"')
    return HTMLResponse(body, headers={"Referrer-Policy": "no-referrer"})
