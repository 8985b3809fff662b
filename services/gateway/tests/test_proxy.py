"""HTTP proxying through a real gateway to real upstreams."""

from __future__ import annotations

import json

import httpx


async def test_forwards_method_path_query_body_and_headers(stack, gateway):
    auth = stack.bearer()
    async with httpx.AsyncClient(base_url=gateway) as client:
        resp = await client.post(
            "/api/catalog/echo?x=1&y=a%20b&x=2",
            content=b'{"hello": "world"}',
            headers={
                **auth,
                "Content-Type": "application/json",
                "X-Custom": "kept",
                "Connection": "keep-alive, X-Hop",
                "X-Hop": "dropped",
            },
        )
    assert resp.status_code == 200, resp.text
    seen = resp.json()
    assert seen["method"] == "POST"
    assert seen["path"] == "/echo"
    assert seen["query"] == "x=1&y=a%20b&x=2"
    assert seen["body"] == '{"hello": "world"}'
    h = seen["headers"]
    assert h["x-custom"] == ["kept"]
    assert h["content-type"] == ["application/json"]
    assert h["authorization"] == [auth["Authorization"]]  # passed through unchanged
    assert "x-hop" not in h  # named in Connection: hop-by-hop
    assert h["x-forwarded-for"] == ["127.0.0.1"]
    assert h["x-forwarded-proto"] == ["http"]
    assert h["x-forwarded-host"] == [gateway.removeprefix("http://")]
    assert h["host"] == [stack.catalog_url.removeprefix("http://")]


async def test_percent_encoding_of_the_path_is_preserved(stack, gateway):
    async with httpx.AsyncClient(base_url=gateway) as client:
        resp = await client.get("/api/catalog/echo%3Fnot-a-query", headers=stack.bearer())
    # The upstream receives the path still encoded, so it is not mistaken for a query.
    assert resp.status_code == 404
    async with httpx.AsyncClient(base_url=gateway) as client:
        resp = await client.get("/api/catalog/ech%6F", headers=stack.bearer())
    assert resp.status_code == 200
    assert resp.json()["raw_path"] == "/ech%6F"


async def test_non_ascii_header_bytes_pass_unchanged(stack, gateway):
    async with httpx.AsyncClient(base_url=gateway) as client:
        resp = await client.get("/api/catalog/echo", headers={**stack.bearer(), "X-Name": "café".encode()})
    assert resp.status_code == 200
    assert resp.json()["headers"]["x-name"] == ["café"]  # the upstream decodes the same UTF-8 bytes


async def test_a_client_forwarded_for_is_not_passed_on(stack, gateway):
    """From a peer that is not a trusted proxy, only the peer reaches the service (issue 17: a hop the client
    wrote reached identity's audit source and login throttle)."""
    async with httpx.AsyncClient(base_url=gateway) as client:
        resp = await client.get(
            "/api/catalog/echo",
            headers={**stack.bearer(), "X-Forwarded-For": "203.0.113.9", "X-Forwarded-Proto": "https"},
        )
    h = resp.json()["headers"]
    assert h["x-forwarded-for"] == ["127.0.0.1"]
    assert h["x-forwarded-proto"] == ["http"]  # the peer is not a trusted proxy


async def test_a_client_forwarding_headers_never_reach_a_service(stack, gateway):
    """Forwarded, X-Real-IP and the X-Forwarded-* the gateway does not set itself are dropped: only the
    gateway tells a service where a request came from (issue 28)."""
    claims = {
        "Forwarded": "for=203.0.113.9;proto=https",
        "X-Real-IP": "203.0.113.9",
        "X-Forwarded-Port": "443",
        "X-Forwarded-Prefix": "/admin",
        "X-Forwarded-Server": "evil.example",
    }
    async with httpx.AsyncClient(base_url=gateway) as client:
        resp = await client.get("/api/catalog/echo", headers={**stack.bearer(), **claims})
    h = resp.json()["headers"]
    assert not {name.lower() for name in claims} & set(h), h
    assert h["x-forwarded-for"] == ["127.0.0.1"]


def test_the_apps_proxy_passes_no_client_forwarding_header_to_a_workload():
    from gpuaas.gateway.apps import Upstream, _upstream_headers

    raw = [
        (b"x-forwarded-for", b"6.6.6.6"),
        (b"x-forwarded-proto", b"https"),
        (b"x-forwarded-host", b"evil.example"),
        (b"forwarded", b"for=6.6.6.6"),
        (b"x-real-ip", b"6.6.6.6"),
        (b"accept", b"text/html"),
    ]
    up = Upstream(host="127.0.0.1", port=1, base_path="", header="x-app-secret", value="s")
    out = _upstream_headers(raw, up, "198.51.100.7", set())
    names = [n for n, _ in out]
    assert ("x-forwarded-for", "198.51.100.7") in out and names.count("x-forwarded-for") == 1
    assert not {"x-forwarded-proto", "x-forwarded-host", "forwarded", "x-real-ip"} & set(names), out
    assert ("accept", "text/html") in out


async def test_trusted_proxy_forwarded_headers_are_believed(stack, clock):
    gateway = await stack.gateway(clock=clock, trusted_proxies=["127.0.0.1"], rate_limit_per_s=1, rate_limit_burst=1)
    async with httpx.AsyncClient(base_url=gateway) as client:
        first = await client.get(
            "/api/identity/auth/login", headers={"X-Forwarded-For": "203.0.113.9", "X-Forwarded-Proto": "https"}
        )
        other_client = await client.get("/api/identity/auth/login", headers={"X-Forwarded-For": "203.0.113.10"})
        same_client = await client.get("/api/identity/auth/login", headers={"X-Forwarded-For": "203.0.113.9"})
    assert first.status_code == 200
    # The limit keys on the address behind the proxy, not on the proxy itself.
    assert other_client.status_code == 200
    assert same_client.status_code == 429


async def test_correlation_id_is_created_forwarded_and_echoed(stack, gateway):
    async with httpx.AsyncClient(base_url=gateway) as client:
        created = await client.get("/api/catalog/echo", headers=stack.bearer())
        given = await client.get("/api/catalog/echo", headers={**stack.bearer(), "X-Correlation-ID": "req-42.a"})
    cid = created.headers["x-correlation-id"]
    assert len(cid) >= 16
    assert created.json()["headers"]["x-correlation-id"] == [cid]
    assert created.headers.get_list("x-correlation-id") == [cid]  # the upstream's copy is not duplicated
    assert given.headers.get_list("x-correlation-id") == ["req-42.a"]
    assert given.json()["headers"]["x-correlation-id"] == ["req-42.a"]


async def test_upstream_status_and_headers_are_returned(stack, gateway):
    async with httpx.AsyncClient(base_url=gateway) as client:
        resp = await client.get("/api/catalog/teapot", headers=stack.bearer())
    assert resp.status_code == 418
    assert resp.json() == {"short": "and stout"}
    assert resp.headers["x-upstream"] == "catalog"
    assert resp.headers.get_list("set-cookie") == ["a=1; Path=/", "b=2; Path=/"]
    assert resp.headers["content-type"] == "application/json"


async def test_head_and_delete_are_forwarded(stack, gateway):
    async with httpx.AsyncClient(base_url=gateway) as client:
        deleted = await client.delete("/api/catalog/echo", headers=stack.bearer())
        head = await client.head("/api/catalog/healthz")
    assert deleted.json()["method"] == "DELETE"
    assert head.status_code == 405  # the upstream route is GET-only; its answer comes back
    assert head.content == b""


async def test_unknown_service_is_404_problem(stack, gateway):
    async with httpx.AsyncClient(base_url=gateway) as client:
        resp = await client.get("/api/nope/anything", headers=stack.bearer())
    assert resp.status_code == 404
    assert resp.headers["content-type"] == "application/problem+json"
    assert resp.json()["code"] == "unknown_service"


async def test_upstream_down_is_502_problem(stack, gateway):
    async with httpx.AsyncClient(base_url=gateway) as client:
        resp = await client.get("/api/billing/anything", headers=stack.bearer())
        metrics = await client.get("/metrics")
    assert resp.status_code == 502
    body = resp.json()
    assert resp.headers["content-type"] == "application/problem+json"
    assert body["code"] == "upstream_unavailable"
    assert body["correlation_id"] == resp.headers["x-correlation-id"]
    unavailable = 'gpuaas_upstream_requests_total{service="gateway",status="unavailable",upstream="billing"} 1.0'
    assert unavailable in metrics.text


async def test_upstream_timeout_is_504_problem(stack):
    gateway = await stack.gateway(upstream_timeout_s=0.3)
    async with httpx.AsyncClient(base_url=gateway) as client:
        resp = await client.get("/api/catalog/slow", headers=stack.bearer())
        fast = await client.get("/api/catalog/echo", headers=stack.bearer())
    assert resp.status_code == 504
    assert resp.json()["code"] == "upstream_timeout"
    assert fast.status_code == 200  # the pool is still usable


async def test_body_over_limit_is_413_declared_or_streamed(stack):
    gateway = await stack.gateway(max_request_bytes=1000)

    async def chunks():
        for _ in range(10):
            yield b"x" * 500

    async with httpx.AsyncClient(base_url=gateway) as client:
        declared = await client.post("/api/catalog/upload", content=b"x" * 1001, headers=stack.bearer())
        streamed = await client.post("/api/catalog/upload", content=chunks(), headers=stack.bearer())
        within = await client.post("/api/catalog/upload", content=b"x" * 1000, headers=stack.bearer())
    for resp in (declared, streamed):
        assert resp.status_code == 413
        assert resp.headers["content-type"] == "application/problem+json"
        assert resp.json()["code"] == "payload_too_large"
    assert within.json() == {"received": 1000}
    assert 1001 not in stack.catalog.state.uploaded


async def test_large_streamed_upload_arrives_whole(stack):
    gateway = await stack.gateway(max_request_bytes=10_000_000)

    async def chunks():
        for i in range(64):
            yield bytes([i]) * 65536

    async with httpx.AsyncClient(base_url=gateway) as client:
        resp = await client.post("/api/catalog/upload", content=chunks(), headers=stack.bearer())
    assert resp.json() == {"received": 64 * 65536}


async def test_dot_segments_are_refused(stack, gateway):
    async with httpx.AsyncClient(base_url=gateway) as client:
        # Encoded so that the client does not resolve it: auth/../echo would skip the token check.
        resp = await client.get("/api/identity/auth/%2e%2e/echo")
    assert resp.status_code == 400
    assert resp.json()["code"] == "invalid_path"


async def test_proxied_errors_from_upstream_pass_through_unchanged(stack, gateway):
    async with httpx.AsyncClient(base_url=gateway) as client:
        resp = await client.get("/api/catalog/items/not-an-int", headers=stack.bearer())
    assert resp.status_code == 422
    assert resp.headers["content-type"] == "application/json"  # the upstream's own body, not rewrapped
    assert json.loads(resp.content)["detail"][0]["loc"] == ["path", "item_id"]
