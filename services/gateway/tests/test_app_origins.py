"""An origin per launchable app (GPUAAS_GATEWAY_APPS_DOMAIN): a browser is sent from the console's host to
`{id}.<apps domain>`, an app host serves only its own app, another origin's requests are refused, the cookie
is set on the app's host, and an expired one goes back to the console by its absolute URL."""

from __future__ import annotations

import uuid
from typing import Any
from urllib.parse import parse_qs

import httpx
import pytest
from fastapi import FastAPI
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from gpuaas.gateway.app_origins import AppOrigins
from gpuaas.kit import workload_tokens

from .conftest import Stack, plain_config

DOMAIN = "apps.localhost"
NAVIGATE = {"sec-fetch-mode": "navigate", "accept": "text/html"}


# ----------------------------------------------------------------------------------------- the rules


def test_origins_follow_the_consoles_scheme_and_port() -> None:
    iid = uuid.uuid4()
    assert AppOrigins.of(DOMAIN, "http://127.0.0.1:8000").origin_of(iid) == f"http://{iid}.apps.localhost:8000"
    prod = AppOrigins.of("Apps.Example.com.", "https://gpu.example.com/")
    assert prod is not None and prod.origin_of(iid) == f"https://{iid}.apps.example.com"
    assert AppOrigins.of(None, "https://gpu.example.com") is None  # off: apps on the console's origin


@pytest.mark.parametrize(
    ("domain", "url"),
    [
        (DOMAIN, None),
        (DOMAIN, "ftp://x"),
        ("example.com", "https://gpu.example.com"),
        (DOMAIN, "http://apps.localhost"),
    ],
)
def test_a_bad_pair_is_refused_at_start(domain: str, url: str | None) -> None:
    with pytest.raises(ValueError):
        AppOrigins.of(domain, url)


def test_an_app_host_serves_its_own_app_only() -> None:
    o = AppOrigins.of(DOMAIN, "http://127.0.0.1:8000")
    assert o is not None
    iid, other = uuid.uuid4(), uuid.uuid4()
    host = f"{iid}.apps.localhost:8000"
    assert o.instance_of_host(host) == iid and o.instance_of_host(host.upper()) == iid
    assert o.host_serves(host, f"/apps/{iid}/lab") and o.host_serves(host, f"/apps/{iid}")
    for path in ("/", "/api/identity/me", f"/apps/{other}/lab", f"/apps/{iid}x/", "/assets/index.js"):
        assert not o.host_serves(host, path), path
    for bad in ("x.apps.localhost", f"a.{iid}.apps.localhost", "apps.localhost"):  # no instance named
        assert not o.host_serves(bad, f"/apps/{iid}/"), bad
    assert o.host_serves("127.0.0.1:8000", "/api/identity/me")  # the console's host: everything
    assert o.same_origin(iid, None) and o.same_origin(iid, f"http://{iid}.apps.localhost:8000")
    assert not o.same_origin(iid, "http://127.0.0.1:8000")
    assert not o.same_origin(iid, f"http://{other}.apps.localhost:8000")


# ----------------------------------------------------------------------------------------- the gateway


def _app_runtime(iid: uuid.UUID) -> FastAPI:
    """app-runtime's workload answer for one instance; the workload itself listens nowhere."""
    app = FastAPI()
    answer = {"host": "127.0.0.1", "port": 9, "base_path": f"/apps/{iid}/", "authenticated": True}

    @app.get("/instances/{i}/workload")
    async def get(i: uuid.UUID) -> Any:
        return answer

    @app.post("/instances/{i}/workload/open")
    async def open_(i: uuid.UUID) -> Any:
        return answer

    return app


CONSOLE = "http://console.test:8000"  # GPUAAS_GATEWAY_PUBLIC_URL: the app hosts share its scheme and port


async def _gateway(stack: Stack, iid: uuid.UUID, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """A gateway with an apps domain (requests reach it with the Host a browser would send); the app's host."""
    monkeypatch.setenv(workload_tokens.ENV, "app-origins-test-key-0123456789abcdef")
    app_runtime = await stack.servers.start(plain_config(_app_runtime(iid)))
    upstreams = {**stack.settings().upstreams, "app-runtime": app_runtime}
    gateway = await stack.gateway(upstreams=upstreams, apps_domain=DOMAIN, public_url=CONSOLE)
    return gateway, f"{iid}.{DOMAIN}:8000"


async def test_a_browser_is_sent_to_the_apps_own_origin(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    iid = uuid.uuid4()
    gateway, app_host = await _gateway(stack, iid, monkeypatch)
    token = stack.issuer.token()
    async with httpx.AsyncClient(base_url=gateway) as c:
        # The console's Open button (and the CLI's URL): same path and query on the app's host, method kept.
        for method in ("GET", "POST"):
            r = await c.request(method, f"/apps/{iid}/lab?access_token={token}&x=1", headers=NAVIGATE)
            assert r.status_code == 307, r.text
            assert r.headers["location"] == f"http://{app_host}/apps/{iid}/lab?access_token={token}&x=1"
        # On the app's host the token becomes a cookie for that host and path: Lax (the console is another
        # site) and HttpOnly; the token leaves the URL.
        r = await c.get(f"/apps/{iid}/lab?access_token={token}", headers={**NAVIGATE, "host": app_host})
        assert r.status_code == 303 and r.headers["location"] == f"/apps/{iid}/lab", r.text
        cookie = r.headers["set-cookie"].lower()
        assert f"path=/apps/{iid}/" in cookie and "samesite=lax" in cookie and "httponly" in cookie
        assert "domain=" not in cookie  # host-only: no other app's host gets it
        # An expired cookie on the app's host: back to the console by its absolute URL.
        expired = stack.issuer.token(exp_in=-60)
        r = await c.get(
            f"/apps/{iid}/lab", headers={**NAVIGATE, "host": app_host, "cookie": f"gpuaas_app_session={expired}"}
        )
        assert r.status_code == 303, r.text
        page, _, query = r.headers["location"].partition("?")
        assert page == f"{CONSOLE}/#/instances/{iid}/reopen"
        assert parse_qs(query) == {"path": [f"/apps/{iid}/lab"]}
        # A bearer token is no ambient credential: CLI and scripts are served where they call (here the
        # workload listens nowhere: the proxy's 502, not a redirect).
        r = await c.get(f"/apps/{iid}/lab", headers={"authorization": f"Bearer {token}"})
        assert r.status_code == 502 and r.json()["code"] == "workload_unavailable", r.text


async def test_an_app_host_serves_nothing_else(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    iid = uuid.uuid4()
    gateway, app_host = await _gateway(stack, iid, monkeypatch)
    bearer = stack.bearer()
    async with httpx.AsyncClient(base_url=gateway) as c:
        for path in ("/", "/api/identity/things", f"/apps/{uuid.uuid4()}/lab", "/openapi.json"):
            r = await c.get(path, headers={**bearer, "host": app_host})
            assert r.status_code == 404 and r.json()["code"] == "not_found", (path, r.text)
        assert (await c.get("/api/identity/items/1", headers=bearer)).status_code == 200  # the console's host
    ws = gateway.replace("http", "ws", 1)
    with pytest.raises(InvalidStatus):
        async with connect(f"{ws}/api/identity/ws/echo", additional_headers={"host": app_host}, proxy=None):
            pass


async def test_another_origin_cannot_call_the_app(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another app's page (same site: a sibling host) or any other site, with the viewer's cookie."""
    iid = uuid.uuid4()
    gateway, app_host = await _gateway(stack, iid, monkeypatch)
    cookie = {"cookie": f"gpuaas_app_session={stack.issuer.token()}", "host": app_host}
    own = f"http://{app_host}"
    async with httpx.AsyncClient(base_url=gateway) as c:
        for origin in (f"http://{uuid.uuid4()}.{DOMAIN}:8000", CONSOLE, "https://evil.example"):
            r = await c.post(f"/apps/{iid}/api/contents", headers={**cookie, "origin": origin})
            assert r.status_code == 403 and r.json()["code"] == "cross_origin_refused", (origin, r.text)
        r = await c.post(f"/apps/{iid}/api/contents", headers={**cookie, "origin": own})
        assert r.status_code == 502, r.text  # admitted: on to the (absent) workload
    ws = gateway.replace("http", "ws", 1)
    for headers in ({**cookie, "origin": "https://evil.example"}, {"cookie": cookie["cookie"]}):
        with pytest.raises(InvalidStatus) as refused:  # another origin, or a page on the console's host
            async with connect(f"{ws}/apps/{iid}/api/kernels/k/channels", additional_headers=headers, proxy=None):
                pass
        assert refused.value.response.status_code == 403, headers
