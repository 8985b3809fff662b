"""One OpenAPI 3.1 document for the whole API, merged from every upstream's /openapi.json.

Each upstream's paths get its /api/<segment> prefix, its component names (schemas, responses,
parameters, ...) and every `#/components/...` reference get a `<service>.` prefix so equally named
models of two services don't collide, and operation ids and tags get the service too. Bearer
security schemes collapse into the gateway's single `bearerAuth`. Upstream documents are cached
for `ttl_s`; an upstream that cannot be fetched is left out and named in the description and in
`x-gpuaas-upstreams`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from gpuaas.gateway.upstreams import Upstream, is_public
from gpuaas.kit.logging import get_logger

log = get_logger(__name__)

REF_PREFIX = "#/components/"
BEARER = "bearerAuth"
HTTP_METHODS = frozenset({"get", "put", "post", "delete", "options", "head", "patch", "trace"})


@dataclass(frozen=True)
class Fetched:
    spec: dict[str, Any] | None
    error: str | None
    at: float


class OpenAPIAggregator:
    def __init__(
        self,
        client: httpx.AsyncClient,
        upstreams: dict[str, Upstream],
        *,
        ttl_s: float = 30.0,
        timeout_s: float = 3.0,
        failure_ttl_s: float = 5.0,
        version: str = "0.1.0",
    ) -> None:
        self.client = client
        self.upstreams = upstreams
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.failure_ttl_s = min(failure_ttl_s, ttl_s)
        self.version = version
        self._cache: dict[str, Fetched] = {}
        self._lock = asyncio.Lock()

    async def document(self) -> dict[str, Any]:
        async with self._lock:  # one refresh at a time, however many readers
            fetched = await asyncio.gather(*(self._get(u) for u in self.upstreams.values()))
        return merge_openapi(list(zip(self.upstreams.values(), fetched, strict=True)), version=self.version)

    async def _get(self, upstream: Upstream) -> Fetched:
        now = time.monotonic()
        cached = self._cache.get(upstream.name)
        if cached and now - cached.at < (self.ttl_s if cached.spec is not None else self.failure_ttl_s):
            return cached
        try:
            resp = await self.client.get(f"{upstream.base_url}/openapi.json", timeout=self.timeout_s)
            resp.raise_for_status()
            spec = resp.json()
            if not isinstance(spec, dict) or not isinstance(spec.get("paths", {}), dict):
                raise ValueError("not an OpenAPI document")
            fetched = Fetched(spec, None, now)
        except httpx.HTTPStatusError as exc:
            fetched = Fetched(None, f"answered {exc.response.status_code}", now)
        except httpx.TimeoutException:
            fetched = Fetched(None, "timed out", now)
        except httpx.HTTPError as exc:
            fetched = Fetched(None, f"unreachable ({exc.__class__.__name__})", now)
        except ValueError as exc:
            fetched = Fetched(None, f"invalid document ({exc})", now)
        if fetched.error:
            log.warning("openapi_fetch_failed", service=upstream.name, error=fetched.error)
        self._cache[upstream.name] = fetched
        return fetched


def merge_openapi(parts: list[tuple[Upstream, Fetched]], *, version: str = "0.1.0") -> dict[str, Any]:
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "GPUaaS API", "version": version},
        "paths": {},
        "components": {
            "securitySchemes": {BEARER: {"type": "http", "scheme": "bearer", "bearerFormat": "JWT"}},
        },
        "security": [{BEARER: []}],
        "tags": [],
    }
    status: dict[str, dict[str, Any]] = {}
    lines = []
    for upstream, fetched in parts:
        if fetched.spec is None:
            status[upstream.segment] = {"available": False, "error": fetched.error}
            lines.append(f"- **{upstream.segment}**: unavailable ({fetched.error}); its operations are missing here.")
            continue
        _merge_one(doc, upstream, fetched.spec)
        upstream_version = fetched.spec.get("info", {}).get("version", "?")
        status[upstream.segment] = {"available": True, "version": upstream_version}
        lines.append(f"- **{upstream.segment}**: `/api/{upstream.segment}/`, version {upstream_version}")
    doc["info"]["description"] = (
        "The GPUaaS API as served by the gateway: every service under `/api/<service>/`, authenticated "
        "with a bearer JWT from identity (except identity's `auth`, `oauth`, `oidc` and `.well-known` paths).\n\n"
        "Services:\n" + "\n".join(lines)
    )
    doc["x-gpuaas-upstreams"] = status
    return doc


def _merge_one(doc: dict[str, Any], upstream: Upstream, spec: dict[str, Any]) -> None:
    prefix = upstream.name
    components = spec.get("components", {}) or {}
    schemes = components.get("securitySchemes", {}) or {}
    # Bearer schemes become the gateway's one; others are kept, renamed like every component.
    scheme_names = {
        name: BEARER if _is_bearer(s) else f"{prefix}.{name}" for name, s in schemes.items() if isinstance(s, dict)
    }

    def rename(ref: str) -> str:
        kind, _, name = ref.removeprefix(REF_PREFIX).partition("/")
        if kind == "securitySchemes":
            return f"{REF_PREFIX}{kind}/{scheme_names.get(name, name)}"
        return f"{REF_PREFIX}{kind}/{prefix}.{name}" if name else ref

    def fix(value: Any) -> Any:
        return _rewrite_refs(value, rename)

    for kind, entries in components.items():
        if not isinstance(entries, dict):
            continue
        target = doc["components"].setdefault(kind, {})
        for name, entry in entries.items():
            if kind == "securitySchemes":
                if scheme_names.get(name, BEARER) != BEARER:
                    target[scheme_names[name]] = fix(entry)
            else:
                target[f"{prefix}.{name}"] = fix(entry)

    untagged = False
    for path, item in (spec.get("paths") or {}).items():
        if not isinstance(item, dict):
            continue
        item = fix(item)
        for method, op in item.items():
            if method not in HTTP_METHODS or not isinstance(op, dict):
                continue
            if "operationId" in op:
                op["operationId"] = f"{prefix}.{op['operationId']}"
            op["tags"] = [_tag(upstream, t) for t in op.get("tags", [])] or [upstream.segment]
            untagged = untagged or op["tags"] == [upstream.segment]
            if "security" in op:
                op["security"] = _rename_requirements(op["security"], scheme_names)
            elif is_public(upstream, path):
                op["security"] = []
        doc["paths"][f"/api/{upstream.segment}{path}"] = item

    seen = {t["name"] for t in doc["tags"]}
    for tag in spec.get("tags", []) or []:
        if isinstance(tag, dict) and "name" in tag:
            renamed = {**tag, "name": _tag(upstream, tag["name"])}
            if renamed["name"] not in seen:
                doc["tags"].append(renamed)
                seen.add(renamed["name"])
    if untagged and upstream.segment not in seen:
        doc["tags"].append({"name": upstream.segment, "description": spec.get("info", {}).get("description", "")})


def _tag(upstream: Upstream, tag: str) -> str:
    return f"{upstream.segment}: {tag}"


def _is_bearer(scheme: dict[str, Any]) -> bool:
    return scheme.get("type") == "http" and str(scheme.get("scheme", "")).lower() == "bearer"


def _rename_requirements(requirements: Any, names: dict[str, str]) -> Any:
    if not isinstance(requirements, list):
        return requirements
    return [{names.get(k, k): v for k, v in req.items()} if isinstance(req, dict) else req for req in requirements]


def _rewrite_refs(value: Any, rename: Callable[[str], str]) -> Any:
    """A copy of `value` with every `#/components/...` string (`$ref`, discriminator mappings) renamed."""
    if isinstance(value, dict):
        return {k: _rewrite_refs(v, rename) for k, v in value.items()}
    if isinstance(value, list):
        return [_rewrite_refs(v, rename) for v in value]
    if isinstance(value, str) and value.startswith(REF_PREFIX):
        return rename(value)
    return value
