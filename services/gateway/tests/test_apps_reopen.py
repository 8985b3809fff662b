"""`/apps/{id}/` when the admission cookie has expired: a page load goes back through the console (which has
the session to get a fresh token from) and returns to the same page; anything else gets the 401, and a token
handed over in the URL that fails is a 401 too (never a redirect loop)."""

from __future__ import annotations

import uuid
from urllib.parse import parse_qs

import httpx

NAVIGATE = {"sec-fetch-mode": "navigate", "accept": "text/html,application/xhtml+xml"}


async def test_expired_app_page_goes_back_through_the_console(stack, gateway):
    iid = uuid.uuid4()
    expired = stack.issuer.token(exp_in=-60)
    cookie = {"cookie": f"gpuaas_app_session={expired}; _xsrf=abc"}
    async with httpx.AsyncClient(base_url=gateway) as c:
        for headers in ({**NAVIGATE, **cookie}, NAVIGATE, {"accept": "text/html", **cookie}):  # no Sec-Fetch: Accept
            r = await c.get(f"/apps/{iid}/lab/tree/work.ipynb?reset=1", headers=headers)
            assert r.status_code == 303, (headers, r.text)
            assert r.headers["cache-control"] == "no-store"
            page, _, query = r.headers["location"].partition("?")
            assert page == f"/#/instances/{iid}/reopen"
            assert parse_qs(query) == {"path": [f"/apps/{iid}/lab/tree/work.ipynb?reset=1"]}

        # JupyterLab's own calls (fetch, XHR) and writes cannot follow a sign-in: the 401 problem.
        for method, headers in (("GET", {"sec-fetch-mode": "cors", "accept": "text/html", **cookie}),
                                ("GET", {"accept": "application/json", **cookie}),
                                ("POST", {**NAVIGATE, **cookie})):  # fmt: skip
            r = await c.request(method, f"/apps/{iid}/api/sessions", headers=headers)
            assert r.status_code == 401, (method, headers)
            assert r.headers["content-type"] == "application/problem+json"
            assert r.json()["code"] in ("invalid_token", "missing_token")

        # What the console hands back, when it fails, is refused outright: no loop.
        r = await c.get(f"/apps/{iid}/lab", params={"access_token": expired}, headers=NAVIGATE)
        assert r.status_code == 401 and r.json()["code"] == "invalid_token"
        # Not an instance id: 404 as before, not a trip to the console.
        r = await c.get("/apps/not-an-id/lab", headers=NAVIGATE)
        assert r.status_code == 404
