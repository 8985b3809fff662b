"""deploy/observability (issue 16): the alert rules and their unit tests through the real promtool, the scrape
configs, and the Grafana dashboards (well-formed JSON, valid PromQL, only metrics the services export).

`make observability-check` runs promtool directly as well; promtool comes from the Debian `prometheus`
package (`make install`)."""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuaas.kit.metrics import ServiceMetrics

HERE = Path(__file__).resolve().parent.parent
PROMETHEUS = HERE / "prometheus"
DASHBOARDS = HERE / "grafana" / "dashboards"
SERVICES = ["identity", "allocations", "catalog", "app_runtime", "metering", "billing"]
EXPECTED_DASHBOARDS = {"platform-overview", "service-red", "event-pipeline", "capacity", "billing"}
EXPECTED_ALERTS = {
    "GpuaasOutboxLagging",
    "GpuaasOutboxStuck",
    "GpuaasConsumerStalled",
    "GpuaasDeadLetters",
    "GpuaasServiceNotReady",
    "GpuaasServiceDown",
    "GpuaasLedgerImbalance",
    "GpuaasBillingLagging",
    "GpuaasHostHeartbeatLost",
    "GpuaasGpuCapacityLow",
    "GpuaasCapacityQueueBelowGuarantee",
}
# Grafana's variables, replaced by something PromQL parses.
VARIABLES = {"$__rate_interval": "5m", "$service": "identity", "$route": ".*", "$host_class": ".*"}
METRIC = re.compile(r"\b(gpuaas_[a-z0-9_]+)\b")


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: `make install` installs the Debian package prometheus", pytrace=False)
    return path


def run_promtool(*args: str) -> str:
    done = subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def exported_names() -> set[str]:
    """Every sample name the services expose (histograms' _bucket/_sum/_count, counters' _total)."""
    from gpuaas.gateway.runtime import GatewayMetrics

    registries = [GatewayMetrics().service.registry]
    for service in SERVICES:
        spec = importlib.import_module(f"gpuaas.{service}.app").SPEC
        metrics = ServiceMetrics(spec.name)
        if spec.metrics is not None:
            metrics.business = spec.metrics(metrics.registry)
        registries.append(metrics.registry)
    names: set[str] = set()
    for registry in registries:
        for family in registry.collect():
            if family.type == "histogram":
                names |= {f"{family.name}_bucket", f"{family.name}_sum", f"{family.name}_count"}
            elif family.type == "counter":
                names.add(f"{family.name}_total")
            else:
                names.add(family.name)
    return names


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def dashboard_exprs() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, expr) of every query, templating queries included."""
    out = []
    for name, board in dashboards().items():
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                out.append((name, panel["title"], target["expr"]))
        for var in board["templating"]["list"]:
            if var["type"] == "query":
                query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
                inner = re.fullmatch(r"label_values\((.+), *[a-z_]+\)", query)
                assert inner, f"{name}: variable {var['name']} should be label_values(<selector>, <label>)"
                out.append((name, f"variable {var['name']}", inner.group(1)))
    return out


def substitute(expr: str) -> str:
    for var, value in VARIABLES.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr}"
    return expr


# --------------------------------------------------------------------------- alert rules


def test_alert_rules_pass_promtool_check_and_their_unit_tests() -> None:
    assert "SUCCESS" in run_promtool("check", "rules", str(PROMETHEUS / "alerts.yml"))
    assert "SUCCESS" in run_promtool("test", "rules", str(PROMETHEUS / "tests" / "alerts_test.yml"))


def test_every_alert_is_unit_tested_and_documented() -> None:
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    assert set(alerts) >= EXPECTED_ALERTS, EXPECTED_ALERTS - set(alerts)
    tests = yaml.safe_load((PROMETHEUS / "tests" / "alerts_test.yml").read_text())
    firing = {case["alertname"] for t in tests["tests"] for case in t.get("alert_rule_test", []) if case["exp_alerts"]}
    assert set(alerts) <= firing, f"alerts never shown firing in alerts_test.yml: {set(alerts) - firing}"
    readme = (HERE / "README.md").read_text()
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        anchor = rule["annotations"]["runbook_url"].split("#", 1)[1]
        assert anchor == name.lower(), name
        assert f"### {name}" in readme, f"{name} has no section in deploy/observability/README.md"


def test_alerts_and_dashboards_use_only_exported_metrics() -> None:
    exported = exported_names()
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    used = {(f"alert {r['alert']}", m) for g in rules["groups"] for r in g["rules"] for m in METRIC.findall(r["expr"])}
    used |= {(f"{d}: {title}", m) for d, title, expr in dashboard_exprs() for m in METRIC.findall(expr)}
    unknown = sorted({(where, m) for where, m in used if m not in exported})
    assert not unknown, f"metrics no service exports: {unknown}"
    # and the business metrics of the issue are all on a dashboard
    on_boards = {m for _, _, expr in dashboard_exprs() for m in METRIC.findall(expr)}
    for metric in (
        "gpuaas_gpus",
        "gpuaas_allocations",
        "gpuaas_placement_refusals_total",
        "gpuaas_allocation_activation_seconds_bucket",
        "gpuaas_usage_events_rated_total",
        "gpuaas_usage_rating_lag_seconds",
        "gpuaas_ledger_imbalance",
        "gpuaas_member_operations",
        "gpuaas_member_operation_lease_expiries_total",
        "gpuaas_outbox_lag_seconds",
        "gpuaas_consumer_lag_messages",
        "gpuaas_dead_letters",
        "gpuaas_relay_restarts_total",
        "gpuaas_consumer_restarts_total",
        "gpuaas_capacity_waiting_requests",
        "gpuaas_capacity_queue_held_gpus",
        "gpuaas_capacity_queue_guarantee_gpus",
        "gpuaas_capacity_queue_below_guarantee",
    ):
        assert metric in on_boards, metric


# --------------------------------------------------------------------------- scrape configs


@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-local.yml"])
def test_scrape_configs_pass_promtool(config: str) -> None:
    out = run_promtool("check", "config", str(PROMETHEUS / config))
    assert "is valid prometheus config file syntax" in out
    parsed = yaml.safe_load((PROMETHEUS / config).read_text())
    job = parsed["scrape_configs"][0]
    assert job["honor_labels"] is True  # the services' own `service` label wins over a target label


# --------------------------------------------------------------------------- dashboards


def test_dashboards_are_well_formed() -> None:
    boards = dashboards()
    assert set(boards) == EXPECTED_DASHBOARDS
    assert len({b["uid"] for b in boards.values()}) == len(boards)
    for name, board in boards.items():
        assert board["title"].startswith("GPUaaS / ") and board["schemaVersion"] >= 36, name
        variables = {v["name"] for v in board["templating"]["list"]}
        assert "datasource" in variables, name
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        cells: set[tuple[int, int]] = set()
        for panel in board["panels"]:
            pos = panel["gridPos"]
            assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, (name, panel["title"])
            mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
            assert not mine & cells, f"{name}: panel {panel['title']!r} overlaps another"
            cells |= mine
            if panel["type"] == "row":
                continue
            assert panel["datasource"]["uid"] == "${datasource}", (name, panel["title"])
            assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), (name, panel["title"])
            for ref in re.findall(r"\$(\w+)", json.dumps(panel["targets"])):
                assert ref in variables or ref.startswith("__"), f"{name}: {panel['title']} uses undefined ${ref}"


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses every query (Grafana's variables substituted) as a recording rule."""
    rules = [
        {"record": f"gpuaas:dashboard_query:{i}", "expr": substitute(expr)}
        for i, (_, _, expr) in enumerate(dashboard_exprs())
    ]
    assert len(rules) > 60
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    assert f"SUCCESS: {len(rules)} rules found" in run_promtool("check", "rules", str(path))
