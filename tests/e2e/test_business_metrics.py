"""Business metrics on the running stack (issue 16): a short golden path through the gateway (tenant, project,
price, a host with a real node agent in its own host class, an allocation created → active → released, a create
refused for capacity), then every service's /metrics is read, and a real Prometheus (the Debian package's
server) scrapes the whole stack with deploy/observability's alert rules loaded.

Each service exports the facts it owns with `service="<name>"` on every sample: allocations the GPUs, hosts,
allocations, refusals and create→active; metering its meters and usage records; billing the rated usage, the
billing lag and the ledger's balance; app_runtime its member operations; catalog its artifacts; the gateway
its upstream requests."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gpuaas.devstack.stack import Stack
from gpuaas.devstack.waiting import eventually

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "observability" / "prometheus" / "alerts.yml"
SERVICES = ["identity", "allocations", "catalog", "app_runtime", "metering", "billing", "gateway"]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(stack: Stack, service: str) -> Samples:
    """A service's /metrics as {(name, labels without `service`): value}; every sample must carry its service."""
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.get(f"{stack.service_url(service)}/metrics")
    assert r.status_code == 200, r.text
    out: Samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            assert s.labels.get("service") == service, (service, s)
            out[(s.name, frozenset((k, v) for k, v in s.labels.items() if k != "service"))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum over the samples of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def start_agent(stack: Stack, token: str, name: str, gpus: str) -> subprocess.Popen:
    env = stack.agent_env(name, token, gpus, GPUAAS_AGENT_LONG_POLL_S="5")
    log = open(stack.logs_dir / f"agent-{name}.log", "ab")  # noqa: SIM115 - handed to the child
    return subprocess.Popen(
        [sys.executable, "-m", "gpuaas.node_agent"], env=env, stdout=log, stderr=log, start_new_session=True
    )


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def start_prometheus(binary: str, config: Path, data: Path, port: int, logs: Path) -> subprocess.Popen:
    log = open(logs / "prometheus.log", "ab")  # noqa: SIM115 - handed to the child
    return subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=log,
        start_new_session=True,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
async def golden(stack: Stack, admin_token: str) -> AsyncIterator[dict[str, Any]]:
    """The short golden path (once for the module); yields what it made once billing has charged the released
    allocation's GPU time."""
    headers = {"Authorization": f"Bearer {admin_token}"}
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=headers, timeout=30) as gw:
        async for made in _golden(stack, gw):
            yield made


async def _golden(stack: Stack, gw: httpx.AsyncClient) -> AsyncIterator[dict[str, Any]]:
    run = uuid.uuid4().hex[:8]
    host_class = f"metrics-{run}"
    r = await gw.post("/api/identity/tenants", json={"slug": f"metrics-{run}", "name": "Metrics"})
    assert r.status_code == 201, r.text
    tenant = r.json()["tenant_id"]
    r = await gw.post(f"/api/identity/tenants/{tenant}/projects", json={"name": "metrics"})
    assert r.status_code == 201, r.text
    project = r.json()["project_id"]
    price = {
        "unit": "gpu_hour",
        "unit_price": "2.50",
        "currency": "USD",
        "gpu_model": "H100-80GB",
        "shape": "gpu_slice",
        "effective_from": (datetime.now(UTC) - timedelta(days=45)).isoformat(),
    }
    r = await gw.post("/api/billing/prices", json=price)
    assert r.status_code in (201, 409), r.text  # 409: the same price published by another test of the session
    r = await gw.post("/api/allocations/hosts", json={"name": host_class, "host_class": host_class})
    assert r.status_code == 201, r.text
    host = r.json()
    agent = start_agent(stack, host["node_token"], host_class, "4xH100-80GB")
    try:

        async def ready() -> bool:
            return (await gw.get(f"/api/allocations/hosts/{host['host_id']}")).json()["status"] == "ready"

        await eventually(ready, 60, "the host ready")

        async def projected() -> bool:  # allocations, metering and billing know the new project
            for path, params in (
                ("/api/billing/costs", {"project_id": project}),
                ("/api/metering/meters", {"project_id": project}),
                (f"/api/allocations/projects/{project}/allocations", {}),
            ):
                if (await gw.get(path, params=params)).status_code != 200:
                    return False
            return True

        await eventually(projected, 60, "the project in the IAM projections")
        create = {"name": "m", "shape": "gpu_slice", "gpu_model": "H100-80GB", "host_class": host_class}
        r = await gw.post(f"/api/allocations/projects/{project}/allocations", json={**create, "gpu_count": 2})
        assert r.status_code == 201, r.text
        alloc = r.json()
        r = await gw.post(
            f"/api/allocations/projects/{project}/allocations", json={**create, "gpu_count": 3, "queue": False}
        )
        assert r.status_code == 409 and r.json()["code"] == "insufficient_capacity", r.text

        async def status_is(*wanted: str) -> bool:
            a = (await gw.get(f"/api/allocations/allocations/{alloc['allocation_id']}")).json()
            assert a["status"] not in ("failed", "release_failed"), a
            return a["status"] in wanted

        await eventually(lambda: status_is("active"), 120, "the allocation active")
        active = {svc: await scrape(stack, svc) for svc in ("allocations",)}
        r = await gw.post(f"/api/allocations/allocations/{alloc['allocation_id']}/release")
        assert r.status_code in (200, 202), r.text
        await eventually(lambda: status_is("released"), 120, "the allocation released")

        async def charged() -> bool:
            sql = "SELECT count(*) FROM charges WHERE allocation_id = $1"
            return bool(await stack.fetchval("billing", sql, uuid.UUID(alloc["allocation_id"])))

        await eventually(charged, 120, "the released allocation's GPU time charged")
        yield {"host_class": host_class, "allocation": alloc, "while_active": active["allocations"]}
    finally:
        stop(agent)


async def test_every_service_exports_its_business_metrics(stack: Stack, golden: dict[str, Any]) -> None:
    hc = golden["host_class"]
    # allocations: while the allocation was active, 2 of the class's 4 GPUs were used
    during = golden["while_active"]
    assert value(during, "gpuaas_gpus", host_class=hc, state="used") == 2.0
    assert value(during, "gpuaas_gpus", host_class=hc, state="free") == 2.0
    assert total(during, "gpuaas_allocations", status="active") >= 1
    samples = {svc: await scrape(stack, svc) for svc in SERVICES}
    a = samples["allocations"]
    assert value(a, "gpuaas_gpus", host_class=hc, state="free") == 4.0  # released: all free again
    assert value(a, "gpuaas_gpus", host_class=hc, state="used") == 0.0
    assert value(a, "gpuaas_hosts", host_class=hc, status="ready") == 1.0
    assert total(a, "gpuaas_allocations", status="released") >= 1
    assert total(a, "gpuaas_placement_refusals_total", reason="insufficient_capacity") >= 1
    assert total(a, "gpuaas_allocation_activation_seconds_count") >= 1
    # metering: the meter closed at the release, its GPU usage written
    m = samples["metering"]
    assert total(m, "gpuaas_meters", status="closed") >= 1
    assert total(m, "gpuaas_usage_records_emitted_total", kind="gpu") >= 1
    # billing: rated into a balanced ledger, nothing waiting
    b = samples["billing"]
    assert total(b, "gpuaas_usage_events_rated_total", kind="gpu") >= 1
    assert total(b, "gpuaas_usage_rating_delay_seconds_count") >= 1
    assert value(b, "gpuaas_ledger_imbalance", currency="USD") == 0.0
    assert value(b, "gpuaas_ledger_unbalanced_transactions") == 0.0
    assert value(b, "gpuaas_usage_rating_lag_seconds") is not None
    # app_runtime and catalog: their gauges, every status present
    assert value(samples["app_runtime"], "gpuaas_member_operations", kind="add", status="pending") is not None
    assert value(samples["app_runtime"], "gpuaas_member_operation_lease_expiries_total") is not None
    assert value(samples["catalog"], "gpuaas_artifacts", state="active") is not None
    # gateway: the requests it forwarded to allocations
    assert total(samples["gateway"], "gpuaas_upstream_requests_total", upstream="allocations", status="201") >= 1
    # every service: RED and the event pipeline under one name each, none with the old per-service names
    for svc, s in samples.items():
        assert total(s, "gpuaas_http_request_duration_seconds_count") >= 1, svc
        assert not [n for n, _ in s if n.startswith(f"gpuaas_{svc}_")], svc
        if svc != "gateway":
            assert value(s, "gpuaas_ready", check="database") == 1.0, svc
            assert value(s, "gpuaas_dead_letters") is not None, svc
            assert value(s, "gpuaas_outbox_lag_seconds") is not None, svc
            assert total(s, "gpuaas_events_applied_total") >= 1, svc  # every service applies identity's events


async def test_prometheus_scrapes_the_stack_with_the_alert_rules(
    stack: Stack, golden: dict[str, Any], tmp_path: Path
) -> None:
    """The Debian package's Prometheus server scrapes all seven processes (the local scrape config's shape,
    pointed at this stack's ports) and evaluates deploy/observability's rules: all healthy, the ledger alert
    quiet, the business gauges queryable."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("the prometheus server is missing: `make install` installs the Debian package", pytrace=False)
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "gpuaas",
                "honor_labels": True,
                "static_configs": [
                    {"targets": [stack.service_url(svc).removeprefix("http://")], "labels": {"service": svc}}
                    for svc in SERVICES
                ],
            }
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = start_prometheus(binary, tmp_path / "prometheus.yml", tmp_path / "data", port, stack.logs_dir)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as prom:

            async def query(q: str) -> list[dict[str, Any]]:
                r = await prom.get("/api/v1/query", params={"query": q})
                assert r.status_code == 200, r.text
                return list(r.json()["data"]["result"])

            async def all_up() -> bool:
                try:
                    up = await query('up{job="gpuaas"} == 1')
                except (httpx.HTTPError, AssertionError):  # still starting
                    return False
                return {r["metric"]["service"] for r in up} == set(SERVICES)

            await eventually(all_up, 60, "Prometheus scraping every service")
            hc = golden["host_class"]
            free = await query(f'max(gpuaas_gpus{{host_class="{hc}", state="free"}})')
            assert free and float(free[0]["value"][1]) == 4.0
            ready = await query("min by (service) (gpuaas_ready)")
            assert {r["metric"]["service"] for r in ready} == set(SERVICES) - {"gateway"}

            async def rules_evaluated() -> list[dict[str, Any]] | None:
                groups = (await prom.get("/api/v1/rules")).json()["data"]["groups"]
                rules = [rule for g in groups for rule in g["rules"]]
                return rules if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules) else None

            rules = await eventually(rules_evaluated, 30, "every alert rule evaluated")
            assert len(rules) >= 15
            assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
            by_name = {r["name"]: r for r in rules}
            assert by_name["GpuaasLedgerImbalance"]["state"] == "inactive"
            assert by_name["GpuaasServiceDown"]["state"] == "inactive"
    finally:
        stop(proc)
