"""`make chart-check`: render deploy/helm/gpuaas with the real helm for each value set and validate every object.

    uv run python scripts/chart_check.py --helm HELM --crds DIR [--kube-version 1.33.0]

For each value set in deploy/helm/gpuaas/ci/*-values.yaml:

1. `helm lint --strict` and `helm template` (the pinned Kubernetes version);
2. every object against the Kubernetes JSON schemas of that version, strictly (kubernetes-validate, offline:
   an unknown or misspelt field fails); the ServiceMonitor against the Prometheus Operator CRD's own schema
   (`--crds`: the CRD directory of the prometheus-operator Go module, fetched by the Makefile), with unknown
   fields refused as the API server's strict field validation would;
3. the chart's own rules: every variable a container sets is one its component reads (the settings classes,
   as in scripts/config_reference.py), every Secret the migration hook needs exists before it (a hook of
   lower weight, or an existing Secret named in the values), probes on /readyz and /healthz, resource
   limits, inline `python -c` programs compile, only the gateway (and the nginx edge) open to peers outside
   the release, the kinds each value set must produce, the edge's nginx.conf valid for `nginx -t`.

Then value sets that must fail render with the error they must give (a missing required value).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from config_reference import known_env_names

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "gpuaas"
SERVICES = ["identity", "allocations", "catalog", "app-runtime", "metering", "billing"]
# Container variables that are not settings: the NVIDIA container runtime's, the agent's node name.
NOT_SETTINGS = {"NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "NODE_NAME"}
MIGRATE_ENV = {"GPUAAS_MIGRATE_SERVICES", "GPUAAS_MIGRATE_PROVISION", "GPUAAS_DATABASE_URL"}

# Kinds (and how many) each value set must render; anything else rendered is reported.
EXPECT: dict[str, dict[str, int]] = {
    "minimal": {"Deployment": 7, "Service": 7, "PodDisruptionBudget": 7, "NetworkPolicy": 7, "Job": 1, "Secret": 3},
    "external-kafka": {"Deployment": 8, "ConfigMap": 1, "Ingress": 1, "ServiceMonitor": 1, "Job": 1, "Secret": 0},
    "hpa-vault": {
        "Deployment": 7,
        "HorizontalPodAutoscaler": 7,
        "DaemonSet": 1,
        "ServiceMonitor": 1,
        "PrometheusRule": 1,
        "Secret": 3,
    },
    "agent-declared-gpus": {"Deployment": 6, "DaemonSet": 1, "HorizontalPodAutoscaler": 0},
    "openbao": {"Deployment": 7, "Job": 1, "Secret": 3},
}
# (name, --set arguments on top of the minimal set, text the error must contain)
MUST_FAIL = [
    ("vault without a token", ["credentials.backend=vault"], "credentials.vault.tokenSecret.name is required"),
    ("SASL without a user", ["kafka.securityProtocol=SASL_SSL"], "kafka.sasl.username is required"),
    ("keys from Vault without a server", ["vault.keySource=vault"], "vault.keySource vault needs vault.url"),
    ("Vault without the services' AppRoles", ["vault.url=https://v:8200"], "vault.existingSecret is required"),
    ("transit custody without Vault", ["credentials.backend=transit"], "credentials.backend transit needs vault.url"),
    ("agent without a token", ["nodeAgent.enabled=true"], "nodeAgent.tokenSecret.name is required"),
    ("provisioning without admin URL", ["postgres.adminSecret.name="], "postgres.adminSecret.name is required"),
    (
        "scraping blocked by the NetworkPolicies",
        ["serviceMonitor.enabled=true"],
        "needs networkPolicy.metricsNamespaceSelector",
    ),
    ("a misspelt value (values.schema.json)", ["postgres.hots=db"], "additional properties 'hots' not allowed"),
    ("an unknown Kafka protocol", ["kafka.securityProtocol=TLS"], "value must be one of"),
    ("events unsigned", ["eventSigning.existingSecret="], "eventSigning.existingSecret is required"),
    ("no public key for identity", ["eventSigning.verifyKeys="], "eventSigning.verifyKeys is required"),
    (
        "a producer's public key missing (its events would be refused)",
        ["eventSigning.verifyKeys=identity:SLdokJyjaK1bWuEY050/SJOgZ8sKMKFAEQYDBFpbL5A="],
        "eventSigning.verifyKeys has no public key of allocations",
    ),
]


class Failures(list[str]):
    def check(self, ok: bool, message: str) -> None:
        if not ok:
            self.append(message)


def helm(helm_bin: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm_bin, *args], capture_output=True, text=True, check=False)


def render(helm_bin: str, kube: str, values: list[Path], sets: list[str] = ()) -> subprocess.CompletedProcess[str]:
    args = ["template", "gpuaas", str(CHART), "--namespace", "gpuaas", "--kube-version", kube]
    for v in values:
        args += ["-f", str(v)]
    for s in sets:
        args += ["--set", s]
    return helm(helm_bin, *args)


def strict_schema(schema: Any) -> Any:
    """An OpenAPI v3 CRD schema with unknown fields refused wherever the CRD does not keep them."""
    if isinstance(schema, dict):
        out = {k: strict_schema(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict_schema(v) for v in schema]
    return schema


class _CrdLoader(yaml.SafeLoader):
    """PyYAML reads a bare `=` (an enum value in some CRDs) as YAML 1.1's value tag: keep it a string."""


_CrdLoader.add_constructor("tag:yaml.org,2002:value", lambda loader, node: loader.construct_scalar(node))
CRD_FILES = ["monitoring.coreos.com_servicemonitors.yaml", "monitoring.coreos.com_prometheusrules.yaml"]


def crd_schemas(crd_dir: Path) -> dict[tuple[str, str], Any]:
    """(apiVersion, kind) -> the strict schema of each version of the CRDs the chart renders objects of."""
    out = {}
    for name in CRD_FILES:
        crd = yaml.load((crd_dir / name).read_text(), Loader=_CrdLoader)  # a SafeLoader subclass
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            out[(f"{group}/{version['name']}", kind)] = strict_schema(version["schema"]["openAPIV3Schema"])
    return out


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def check_objects(name: str, objs: list[dict[str, Any]], kube: str, crds: dict, known: dict, f: Failures) -> None:
    kinds = Counter(o["kind"] for o in objs)
    for kind, count in EXPECT.get(name, {}).items():
        f.check(kinds.get(kind, 0) == count, f"{name}: expected {count} {kind}, rendered {kinds.get(kind, 0)}")

    rendered_secrets = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Secret"}
    for obj in objs:
        label = f"{name}: {obj['kind']}/{obj['metadata']['name']}"
        key = (obj["apiVersion"], obj["kind"])
        if key in crds:
            errors = list(jsonschema.Draft7Validator(crds[key]).iter_errors(obj))
            f.check(not errors, f"{label}: {'; '.join(e.message for e in errors[:5])}")
        else:
            try:
                kubernetes_validate.validate(obj, kube, strict=True)
            except kubernetes_validate.ValidationError as exc:
                f.append(f"{label}: {exc.message} at {'.'.join(str(p) for p in exc.path)}")
            except kubernetes_validate.SchemaNotFoundError as exc:
                f.append(f"{label}: no schema ({exc.message})")

        component = obj["metadata"].get("labels", {}).get("app.kubernetes.io/component", "")
        for c in containers(obj):
            args = c.get("args", [])
            if args[:2] == ["python", "-c"]:  # inline programs (the migration job, the agent's start) compile
                try:
                    compile(args[2], f"{label} args", "exec")
                except SyntaxError as exc:
                    f.append(f"{label}: its python -c program does not compile: {exc}")
            env = {e["name"] for e in c.get("env", [])}
            if component == "migrate":
                allowed = MIGRATE_ENV | {f"GPUAAS_{s.replace('-', '_').upper()}_DATABASE_URL" for s in SERVICES}
            else:
                allowed = known.get(component, set())
            allowed = allowed | NOT_SETTINGS
            unknown = sorted(env - allowed)
            f.check(not unknown, f"{label}: variables no setting of {component!r} reads: {unknown}")
            if obj["kind"] == "Deployment" and component == "identity":
                # Issue 28: without trusted proxies every login counts as the gateway's address.
                values = {e["name"]: e.get("value") for e in c.get("env", [])}
                trusted = json.loads(values.get("GPUAAS_IDENTITY_TRUSTED_PROXIES") or "[]")
                f.check(bool(trusted), f"{label}: identity trusts no proxy (the gateway)")
            if obj["kind"] == "Deployment":
                ready = c.get("readinessProbe", {}).get("httpGet", {}).get("path")
                live = c.get("livenessProbe", {}).get("httpGet", {}).get("path")
                f.check(ready in ("/readyz", "/healthz") and live == "/healthz", f"{label}: probes {ready}, {live}")
                f.check("limits" in c.get("resources", {}), f"{label}: no resource limits")
            if obj["kind"] == "Job":
                weight = int(obj["metadata"]["annotations"]["helm.sh/hook-weight"])
                for e in c.get("env", []):
                    ref = e.get("valueFrom", {}).get("secretKeyRef")
                    if ref and ref["name"] in rendered_secrets:
                        s = rendered_secrets[ref["name"]]["metadata"].get("annotations", {})
                        before = "pre-install" in s.get("helm.sh/hook", "") and int(s["helm.sh/hook-weight"]) < weight
                        f.check(before, f"{label}: Secret {ref['name']} is not created before the hook")
                        f.check(
                            ref["key"] in rendered_secrets[ref["name"]].get("stringData", {}),
                            f"{label}: Secret {ref['name']} has no key {ref['key']}",
                        )
        if obj["kind"] == "NetworkPolicy" and component not in ("gateway", "edge"):
            for rule in obj["spec"].get("ingress", []):
                f.check(bool(rule.get("from")), f"{label}: an ingress rule open to every peer")
    print(f"  {len(objs)} objects: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))


NGINX = Path("/usr/sbin/nginx")


def check_edge_config(name: str, objs: list[dict[str, Any]], f: Failures) -> None:
    """The nginx edge's rendered config passes `nginx -t` (its Service names pointed at loopback, its state
    directory at a temporary one), where the Debian nginx is installed (deploy/nginx/gpuaas-edge.conf.template)."""
    for obj in objs:
        if obj["kind"] != "ConfigMap" or obj["metadata"].get("labels", {}).get("app.kubernetes.io/component") != "edge":
            continue
        if not NGINX.exists():
            print(f"  {name}: /usr/sbin/nginx is not installed: the edge config is not checked with nginx -t")
            return
        with tempfile.TemporaryDirectory(prefix="gpuaas-chart-edge-") as tmp:
            conf = re.sub(r"server [a-z0-9.-]+:8080;", "server 127.0.0.1:8080;", obj["data"]["nginx.conf"])
            conf = conf.replace("/var/run/gpuaas-edge", tmp)
            (Path(tmp) / "nginx.conf").write_text(conf)
            out = subprocess.run(
                [str(NGINX), "-t", "-e", "stderr", "-p", tmp, "-c", f"{tmp}/nginx.conf"],
                capture_output=True,
                text=True,
                check=False,
            )
        f.check(out.returncode == 0, f"{name}: the edge's nginx.conf fails nginx -t: {out.stderr.strip()}")
        print(f"  edge nginx.conf: nginx -t {'ok' if out.returncode == 0 else 'FAILED'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--helm", default="helm")
    parser.add_argument("--crds", required=True, type=Path, help="prometheus-operator's CRD directory")
    parser.add_argument("--kube-version", default="1.33.0")
    args = parser.parse_args(argv)
    crds = crd_schemas(args.crds)
    known = known_env_names()
    failures = Failures()
    minimal = CHART / "ci" / "minimal-values.yaml"
    sets = sorted((CHART / "ci").glob("*-values.yaml"))
    for values in sets:
        name = values.name.removesuffix("-values.yaml")
        files = [values] if values == minimal else [minimal, values]
        print(f"{name}: {' + '.join(v.name for v in files)}")
        lint = helm(
            args.helm,
            "lint",
            "--strict",
            str(CHART),
            "--kube-version",
            args.kube_version,
            *[a for v in files for a in ("-f", str(v))],
        )
        failures.check(lint.returncode == 0, f"{name}: helm lint failed:\n{lint.stdout}{lint.stderr}")
        out = render(args.helm, args.kube_version, files)
        if out.returncode != 0:
            failures.append(f"{name}: helm template failed: {out.stderr.strip()}")
            continue
        objs = [o for o in yaml.safe_load_all(out.stdout) if o]
        check_objects(name, objs, args.kube_version, crds, known, failures)
        check_edge_config(name, objs, failures)
    for name, extra, error in MUST_FAIL:
        out = render(args.helm, args.kube_version, [minimal], extra)
        ok = out.returncode != 0 and error in out.stderr
        failures.check(ok, f"must fail, {name}: rc={out.returncode} {out.stderr.strip()[:300]}")
        print(f"must fail, {name}: {'refused as expected' if ok else 'NOT refused'}")
    for msg in failures:
        print(f"FAIL {msg}", file=sys.stderr)
    print(
        f"chart-check: {len(sets)} value sets, {len(MUST_FAIL)} refusals, Kubernetes {args.kube_version}: "
        + ("ok" if not failures else f"{len(failures)} failures")
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
