"""The aggregated OpenAPI document: from running upstreams, and the merge rules on their own."""

from __future__ import annotations

from typing import Any

import httpx

from gpuaas.gateway.docs import Fetched, merge_openapi
from gpuaas.gateway.upstreams import Upstream


def all_refs(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [r for k, v in value.items() for r in ([v] if k == "$ref" else all_refs(v))]
    if isinstance(value, list):
        return [r for v in value for r in all_refs(v)]
    return []


def resolve(doc: dict[str, Any], ref: str) -> Any:
    node: Any = doc
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


async def test_aggregated_openapi_merges_two_upstreams_and_survives_one_down(gateway):
    async with httpx.AsyncClient(base_url=gateway) as client:
        resp = await client.get("/openapi.json")
    assert resp.status_code == 200
    doc = resp.json()
    assert doc["openapi"] == "3.1.0"
    paths = doc["paths"]
    assert "/api/identity/items/{item_id}" in paths
    assert "/api/catalog/items/{item_id}" in paths
    assert "/api/identity/auth/login" in paths
    assert not any(p.startswith("/items") for p in paths)
    schemas = doc["components"]["schemas"]
    # The two `Item` models stay apart.
    assert set(schemas["identity.Item"]["properties"]) == {"id", "owner"}
    assert set(schemas["catalog.Item"]["properties"]) == {"id", "price"}
    assert "Item" not in schemas
    refs = all_refs(doc)
    assert "#/components/schemas/catalog.Item" in refs
    for ref in refs:
        resolve(doc, ref)  # every reference points at something that exists
    page = schemas["catalog.Page"]["properties"]["items"]["items"]["$ref"]
    assert page == "#/components/schemas/catalog.Item"
    get_item = paths["/api/catalog/items/{item_id}"]["get"]
    assert get_item["operationId"].startswith("catalog.")
    assert get_item["tags"] == ["catalog: items"]
    assert paths["/api/identity/auth/login"]["get"]["security"] == []  # public
    # billing is configured but down: left out, and said so.
    upstreams = doc["x-gpuaas-upstreams"]
    assert upstreams["billing"]["available"] is False
    assert upstreams["catalog"] == {"available": True, "version": "1.0-catalog"}
    assert "billing**: unavailable" in doc["info"]["description"]
    assert not any(p.startswith("/api/billing") for p in paths)


async def test_openapi_is_cached(stack):
    gateway = await stack.gateway(docs_cache_ttl_s=30)
    async with httpx.AsyncClient(base_url=gateway) as client:
        first = await client.get("/openapi.json")
        second = await client.get("/openapi.json")
    assert first.json()["paths"] == second.json()["paths"]
    assert stack.catalog.state.openapi_fetches == 1


async def test_docs_page_points_at_the_aggregated_document(gateway):
    async with httpx.AsyncClient(base_url=gateway) as client:
        resp = await client.get("/docs")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/html")
    assert "/openapi.json" in resp.text
    assert "swagger" in resp.text.lower()


def _spec(schema_field: str) -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": "x", "version": "2"},
        "tags": [{"name": "things", "description": "Things."}],
        "paths": {
            "/things": {
                "post": {
                    "operationId": "create_thing",
                    "tags": ["things"],
                    "security": [{"HTTPBearer": []}, {"apiKey": []}],
                    "requestBody": {
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Thing"}}}
                    },
                    "responses": {"409": {"$ref": "#/components/responses/Conflict"}},
                }
            },
            "/oauth/callback": {"get": {"responses": {}}},
        },
        "components": {
            "schemas": {
                "Thing": {
                    "oneOf": [{"$ref": "#/components/schemas/A"}],
                    "discriminator": {"propertyName": "kind", "mapping": {"a": "#/components/schemas/A"}},
                },
                "A": {"type": "object", "properties": {schema_field: {"type": "string"}}},
            },
            "responses": {"Conflict": {"description": "conflict"}},
            "securitySchemes": {
                "HTTPBearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "X-Key"},
            },
        },
    }


def test_merge_renames_components_refs_mappings_and_security():
    identity, catalog = Upstream("identity", "http://i"), Upstream("app_runtime", "http://a")
    doc = merge_openapi([(identity, Fetched(_spec("x"), None, 0)), (catalog, Fetched(_spec("y"), None, 0))])
    assert "/api/app-runtime/things" in doc["paths"]
    op = doc["paths"]["/api/app-runtime/things"]["post"]
    assert op["operationId"] == "app_runtime.create_thing"
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"] == (
        "#/components/schemas/app_runtime.Thing"
    )
    assert op["responses"]["409"]["$ref"] == "#/components/responses/app_runtime.Conflict"
    thing = doc["components"]["schemas"]["app_runtime.Thing"]
    assert thing["discriminator"]["mapping"] == {"a": "#/components/schemas/app_runtime.A"}
    assert doc["components"]["schemas"]["identity.A"]["properties"] == {"x": {"type": "string"}}
    assert doc["components"]["schemas"]["app_runtime.A"]["properties"] == {"y": {"type": "string"}}
    # Bearer schemes collapse into the gateway's; others are kept under the service's name.
    schemes = doc["components"]["securitySchemes"]
    assert set(schemes) == {"bearerAuth", "identity.apiKey", "app_runtime.apiKey"}
    assert op["security"] == [{"bearerAuth": []}, {"app_runtime.apiKey": []}]
    assert doc["security"] == [{"bearerAuth": []}]
    assert doc["paths"]["/api/identity/oauth/callback"]["get"]["security"] == []
    assert "security" not in doc["paths"]["/api/app-runtime/oauth/callback"]["get"]  # public only on identity
    assert {"name": "app-runtime: things", "description": "Things."} in doc["tags"]


def test_merge_with_every_upstream_down_is_still_a_document():
    doc = merge_openapi([(Upstream("billing", "http://b"), Fetched(None, "timed out", 0))])
    assert doc["paths"] == {}
    assert doc["x-gpuaas-upstreams"] == {"billing": {"available": False, "error": "timed out"}}
    assert "billing**: unavailable (timed out)" in doc["info"]["description"]
