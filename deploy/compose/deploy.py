"""`make deploy-up` / `deploy-down` / `deploy-wait`: drive deploy/compose/compose.yaml with podman-compose (or
`GPUAAS_COMPOSE="docker compose"`), in phases, because podman-compose 1.0.3 ignores depends_on conditions:

    up       secrets (once), infrastructure (Postgres, 3 Kafka brokers), the migrate job (waited for, exit 0), then
             every service, gateway, lb, node-enrol and node-agent; waits until every replica answers /readyz, the
             gateway front answers /readyz and the node agent's host is ready; prints the time from up to ready
    wait     only the readiness wait (exit 0 when ready)
    down     remove every container, the network and the volumes (the secrets directory is kept)
    secrets  write the secret files that are missing (GPUAAS_SECRETS_DIR, default .local/compose/secrets)

Only the standard library and gpuaas.kit (key generation) are used; run it with `uv run --frozen`.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PROJECT = "gpuaas"
SERVICES = ("identity", "allocations", "catalog", "app-runtime", "metering", "billing")
REPLICAS = [f"{s}-{r}" for s in (*SERVICES, "gateway") for r in "ab"]
INFRA = ("postgres", "kafka-1", "kafka-2", "kafka-3")
ENROLLED_HOST = "compose-node-1"
ADMIN_EMAIL = os.environ.get("GPUAAS_DEPLOY_ADMIN_EMAIL", "admin@gpuaas.example")
READY_TIMEOUT_S = float(os.environ.get("GPUAAS_DEPLOY_READY_TIMEOUT_S", "900"))


def secrets_dir() -> Path:
    return Path(os.environ.get("GPUAAS_SECRETS_DIR", REPO / ".local" / "compose" / "secrets"))


def front_url() -> str:
    return f"http://127.0.0.1:{os.environ.get('GPUAAS_DEPLOY_PORT', '18000')}"


def engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", str(REPO / "deploy" / "local" / "containers.conf"))
    env.setdefault("GPUAAS_SECRETS_DIR", str(secrets_dir()))
    return env


def compose_cmd() -> list[str]:
    # With GPUAAS_DEPLOY_VAULT_URL the services take their keys from that Vault/OpenBao (vault.yaml overlay).
    vault = ["-f", str(HERE / "vault.yaml")] if os.environ.get("GPUAAS_DEPLOY_VAULT_URL") else []
    return [
        *shlex.split(os.environ.get("GPUAAS_COMPOSE", "podman-compose")),
        "-p",
        PROJECT,
        "-f",
        str(HERE / "compose.yaml"),
        *vault,
    ]


def engine() -> str:
    return os.environ.get("GPUAAS_CONTAINER_ENGINE", "podman")


def run(cmd: list[str], *, check: bool = True, quiet: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, env=engine_env(), text=True, capture_output=quiet)
    if check and r.returncode != 0:
        detail = (r.stderr or r.stdout or "")[-3000:] if quiet else ""
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({r.returncode})\n{detail}")
    return r


def compose(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run([*compose_cmd(), *args], check=check)


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


# ------------------------------------------------------------------------------------------------- secrets


def _write(path: Path, value: str) -> None:
    # 0644 inside a 0700 directory: only root reaches it on the host, and the containers' users (postgres, uid
    # 10001) can read the bind-mounted file (compose file secrets cannot set an owner without swarm).
    path.write_text(value + "\n")
    path.chmod(0o644)


def ensure_secrets() -> Path:
    """Every secret file compose.yaml names, generated when missing (existing ones are kept: the database roles,
    sealed rows and signed topics outlive a restart)."""
    from gpuaas.kit.event_signing import generate_seed, public_of
    from gpuaas.kit.secrets_at_rest import generate_key_text

    d = secrets_dir()
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o700)

    def get(name: str, make: Callable[[], str]) -> str:
        p = d / name
        if not p.exists():
            _write(p, make())
        return p.read_text().strip()

    pg = get("postgres-password", lambda: secrets.token_urlsafe(24))
    get("database-admin-url", lambda: f"postgresql://postgres:{quote(pg, safe='')}@postgres:5432/postgres")
    get("admin-password", lambda: secrets.token_urlsafe(16))
    get("secrets-keys", lambda: generate_key_text("compose1"))
    publics = []
    for svc in SERVICES:
        role = svc.replace("-", "_")
        get(
            f"{svc}-database-url",
            lambda role=role: f"postgresql+asyncpg://gpuaas_{role}:{secrets.token_urlsafe(24)}@postgres:5432/gpuaas",
        )
        seed = get(f"{svc}-event-signing-key", generate_seed)
        publics.append(f"{svc}:{public_of(seed)}")
    _write(d / "event-verify-keys", ",".join(sorted(publics)))
    return d


# --------------------------------------------------------------------------------------------------- state


def container_state(name: str) -> dict[str, Any]:
    r = run([engine(), "inspect", "--format", "{{json .State}}", f"{PROJECT}-{name}"], check=False)
    return json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else {}


def wait_exit(name: str, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = container_state(name)
        if st and not st.get("Running") and st.get("Status") in ("exited", "stopped"):
            return int(st.get("ExitCode", 1))
        time.sleep(1)
    raise SystemExit(f"{PROJECT}-{name} did not finish within {timeout_s:.0f} s")


# Run inside one platform container: GET /readyz of each named replica over the compose network (one `exec` per
# round instead of one per replica: a small machine starting 16 Python processes has no CPU to spare).
PROBE = """
import json, sys, urllib.request
ready = {}
for name in sys.argv[1:]:
    port = 8000 if name.startswith("gateway") else 8080
    try:
        with urllib.request.urlopen(f"http://{name}:{port}/readyz", timeout=3) as r:
            ready[name] = r.status == 200
    except Exception:
        ready[name] = False
print(json.dumps(ready))
"""


def replicas_ready(names: list[str]) -> set[str]:
    """The replicas among `names` that answer /readyz (probed from a gateway container; none if both are down)."""
    for probe_from in ("gateway-a", "gateway-b"):
        r = run(
            [engine(), "exec", f"{PROJECT}-{probe_from}", "/opt/gpuaas/venv/bin/python", "-c", PROBE, *names],
            check=False,
        )
        if r.returncode == 0 and r.stdout.strip():
            return {n for n, ok in json.loads(r.stdout.strip().splitlines()[-1]).items() if ok}
    return set()


def http_json(method: str, url: str, **kw: Any) -> tuple[int, Any]:
    data, headers = None, {"Accept": "application/json"}
    if "form" in kw:
        data = "&".join(f"{k}={quote(v)}" for k, v in kw["form"].items()).encode()
        headers["Content-Type"] = "application/x-www-form-urlencoded"
    if "token" in kw:
        headers["Authorization"] = f"Bearer {kw['token']}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers, method=method), timeout=10) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (urllib.error.URLError, OSError, ValueError):
        return 0, None


def host_ready() -> bool:
    password = (secrets_dir() / "admin-password").read_text().strip()
    status, body = http_json(
        "POST",
        f"{front_url()}/api/identity/auth/token",
        form={"grant_type": "password", "username": ADMIN_EMAIL, "password": password},
    )
    if status != 200 or not isinstance(body, dict):
        return False
    status, hosts = http_json("GET", f"{front_url()}/api/allocations/hosts", token=body["access_token"])
    return status == 200 and any(h.get("name") == ENROLLED_HOST and h.get("status") == "ready" for h in hosts)


def wait_ready(timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    pending = set(REPLICAS)
    front = enrolled = False
    while time.monotonic() < deadline:
        pending -= replicas_ready(sorted(pending))
        if not pending:
            front = front or http_json("GET", f"{front_url()}/readyz")[0] == 200
            enrolled = front and (enrolled or host_ready())
            if front and enrolled:
                return
        time.sleep(2)
    what = sorted(pending) or (["the gateway front /readyz"] if not front else [f"host {ENROLLED_HOST} ready"])
    raise SystemExit(f"not ready after {timeout_s:.0f} s: {', '.join(what)} (see `podman logs gpuaas-<name>`)")


# ---------------------------------------------------------------------------------------------- commands


def up() -> float:
    ensure_secrets()
    t0 = time.monotonic()
    log("starting Postgres and 3 Kafka brokers")
    compose("up", "-d", *INFRA)
    log("running the migrate job")
    compose("up", "-d", "migrate")
    rc = wait_exit("migrate", 300)
    if rc != 0:
        print(run([engine(), "logs", "--tail", "40", f"{PROJECT}-migrate"], check=False).stdout, file=sys.stderr)
        raise SystemExit(f"the migrate job failed (exit {rc})")
    log("starting the services (2 replicas each), gateways, lb, node-enrol, node-agent")
    compose("up", "-d")
    wait_ready()
    seconds = time.monotonic() - t0
    log(f"ready: {front_url()} ({len(REPLICAS)} replicas, 3 brokers, host {ENROLLED_HOST}) in {seconds:.0f} s from up")
    return seconds


def down() -> None:
    compose("down", "-v", "-t", "5", check=False)
    # podman-compose 1.0.3 leaves the network and volumes of stopped services behind: remove what is the project's.
    label = f"io.podman.compose.project={PROJECT}"
    if engine() == "podman":
        for kind in ("volume", "network"):
            listed = run([engine(), kind, "ls", "-q", "--filter", f"label={label}"], check=False).stdout.split()
            for name in listed:
                run([engine(), kind, "rm", "-f", name], check=False)
    log("removed the deployment (containers, network, volumes)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("command", choices=["up", "down", "wait", "secrets"])
    args = parser.parse_args(argv)
    if args.command == "up":
        up()
    elif args.command == "down":
        down()
    elif args.command == "wait":
        wait_ready()
    else:
        print(ensure_secrets())
    return 0


if __name__ == "__main__":
    sys.exit(main())
