"""The app-usage example of docs/slurm-reference.md, posted as written (issue 19: it lacked required
fields): only the placeholders an app fills in are replaced."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[3] / "docs" / "slurm-reference.md"


def documented_request() -> tuple[str, str, dict]:
    """(method, path, body) of the first HTTP example under `## App usage`."""
    section = DOC.read_text(encoding="utf-8").split("## App usage", 1)[1]
    block = re.search(r"```http\n(.*?)```", section, re.S)
    assert block, f"no ```http example under '## App usage' in {DOC}"
    head, _, body = block.group(1).partition("\n\n")
    method, path = head.splitlines()[0].split()
    return method, path, json.loads(body)


async def test_the_slurm_reference_app_usage_example_is_accepted(h, metering, auth) -> None:
    client, kit, w = metering
    e = h.instance_created(w["t1"], w["p1"], datetime.now(UTC) - timedelta(days=1), slug="slurm-reference")
    await h.apply(kit, e)
    method, path, body = documented_request()
    assert (method, path) == ("POST", "/api/metering/usage/app")
    body["instance_id"] = str(e.data.instance_id)  # the placeholder an app fills in
    assert datetime.fromisoformat(body["occurred_at"]).tzinfo is not None
    body["occurred_at"] = (datetime.now(UTC) - timedelta(minutes=1)).isoformat()  # inside the window today
    sa = auth(w["sa"], kind="service_account", project_id=str(w["p1"]), scope="app-controller")
    r = await client.request(method, path.removeprefix("/api/metering"), json=body, headers=sa)
    assert r.status_code == 201, r.text
    got = r.json()
    assert (got["unit"], got["quantity"], got["app_slug"]) == ("requests", "1.000000", "slurm-reference")
    again = await client.request(method, path.removeprefix("/api/metering"), json=body, headers=sa)
    assert again.status_code == 200 and again.json()["duplicate"] is True
