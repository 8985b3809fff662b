"""Entry point of the gpuaas-platform image: `<component> [args]` picks what the container runs.

    identity | allocations | catalog | app-runtime | metering | billing | gateway  [serve | migrate | replay ...]
    node-agent          the node agent (waits for its node token file first: see enrol-node)
    migrate             one-shot: database, every service's role and schema, every service's migrations
    enrol-node NAME     one-shot: enrol host NAME through the gateway as the operator, write its node token file
    healthcheck         the image's HEALTHCHECK: GET /healthz of the component this container serves
    ready               GET /readyz of that component (database, broker, consumer group): exit 0 when ready
    help

Secret files: for every variable `GPUAAS_..._FILE` (except settings that are file paths themselves, such as
GPUAAS_AGENT_NODE_TOKEN_FILE) the variable without `_FILE` is set to the file's content (trailing newline
stripped) before the component starts, as the official postgres image does. Compose `secrets:` (mounted at
/run/secrets/<name>) or any read-only mounted directory provide the files; nothing secret sits in the image or in
`podman inspect`. Only the standard library is used before the component's own code is imported.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

SERVICES = ("identity", "allocations", "catalog", "app_runtime", "metering", "billing")
HTTP_COMPONENTS = (*SERVICES, "gateway")
# Settings whose value is a path the component opens itself.
NATIVE_FILE_SETTINGS = {"GPUAAS_AGENT_NODE_TOKEN_FILE"}
HEALTH_URL_FILE = Path("/tmp/gpuaas-health-url")
WAIT_S = float(os.environ.get("GPUAAS_STARTUP_WAIT_S", "300"))


def log(msg: str) -> None:
    print(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "entrypoint": msg}), flush=True)


def load_secret_files() -> None:
    for key, path in list(os.environ.items()):
        if not (key.startswith("GPUAAS_") and key.endswith("_FILE")) or key in NATIVE_FILE_SETTINGS:
            continue
        target = key.removesuffix("_FILE")
        try:
            os.environ[target] = Path(path).read_text().rstrip("\n")
        except OSError as exc:
            sys.exit(f"{key}={path}: cannot read the secret file ({exc.strerror})")
        del os.environ[key]


def module_of(component: str) -> str:
    return "gpuaas." + component.replace("-", "_")


def exec_component(component: str, args: list[str]) -> None:
    name = component.replace("-", "_")
    if name in HTTP_COMPONENTS and (not args or args[0] == "serve"):
        port = os.environ.get(f"GPUAAS_{name.upper()}_PORT", "8000" if name == "gateway" else "8080")
        HEALTH_URL_FILE.write_text(f"http://127.0.0.1:{port}/healthz")
        args = ["serve"]
    python = sys.executable
    os.execv(python, [python, "-m", module_of(component), *args])


def healthcheck(path: str = "/healthz") -> int:
    try:
        url = HEALTH_URL_FILE.read_text().strip().replace("/healthz", path)
    except OSError:
        return 0  # not an HTTP component (agent, job)
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return 0 if r.status == 200 else 1
    except (urllib.error.URLError, OSError):
        return 1


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        try:
            if check():
                return
        except Exception as exc:  # any failure means "not yet"; the last one is reported
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() > deadline:
            sys.exit(f"gave up waiting for {what} after {timeout_s:.0f} s ({last})")
        time.sleep(2)


# ------------------------------------------------------------------------------------------------ migrate


def migrate() -> int:
    """Create the database, every service's role (its password from its database URL) and schema, then run each
    service's migrations with its own role. Idempotent: a second run changes nothing."""
    import asyncio
    import subprocess

    import asyncpg

    from gpuaas.kit.db import to_plain_url
    from gpuaas.kit.provision import ensure_database, ensure_service_schema

    admin_url = os.environ["GPUAAS_DATABASE_ADMIN_URL"]
    urls = {svc: os.environ[f"GPUAAS_{svc.upper()}_DATABASE_URL"] for svc in SERVICES}
    database = urllib.parse.urlsplit(urls["identity"]).path.lstrip("/") or "gpuaas"

    async def ping() -> bool:
        conn = await asyncpg.connect(to_plain_url(admin_url), timeout=5)
        await conn.close()
        return True

    wait_for("Postgres", lambda: asyncio.run(ping()))

    async def provision() -> None:
        await ensure_database(admin_url, database)
        parts = urllib.parse.urlsplit(admin_url)
        db_admin_url = urllib.parse.urlunsplit((parts.scheme, parts.netloc, f"/{database}", parts.query, ""))
        for svc, url in urls.items():
            password = urllib.parse.unquote(urllib.parse.urlsplit(url).password or "")
            await ensure_service_schema(db_admin_url, svc, password)

    t0 = time.monotonic()
    asyncio.run(provision())
    log(f"provisioned database {database!r} and {len(urls)} service roles")
    env = {k: v for k, v in os.environ.items() if k != "GPUAAS_DATABASE_ADMIN_URL"}
    for svc in SERVICES:
        subprocess.run([sys.executable, "-m", module_of(svc), "migrate"], env=env, check=True)
        log(f"migrated {svc}")
    log(f"migrations done in {time.monotonic() - t0:.1f} s")
    return 0


# --------------------------------------------------------------------------------------------- enrol-node


def _request(
    method: str, url: str, *, token: str = "", form: dict[str, str] | None = None, body: object = None
) -> tuple[int, Any]:
    headers = {"Accept": "application/json"}
    data = None
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if form is not None:
        data = urllib.parse.urlencode(form).encode()
        headers["Content-Type"] = "application/x-www-form-urlencoded"
    elif body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw or b"null")
    except ValueError:  # a proxy's HTML error page
        return status, None


def enrol_node(name: str) -> int:
    """Enrol host `name` (or rotate its token if it exists) and write the node token file the agent reads.
    A token file that still works is kept."""
    api = os.environ.get("GPUAAS_ENROL_API_URL", "http://lb:8000").rstrip("/")
    token_file = Path(os.environ.get("GPUAAS_AGENT_NODE_TOKEN_FILE", "/var/lib/gpuaas/agent-token/node-token"))
    email = os.environ["GPUAAS_ENROL_ADMIN_EMAIL"]
    password = os.environ["GPUAAS_ENROL_ADMIN_PASSWORD"]

    def login() -> bool:
        status, body = _request(
            "POST",
            f"{api}/api/identity/auth/token",
            form={"grant_type": "password", "username": email, "password": password},
        )
        if status != 200:
            raise RuntimeError(f"login answered {status}")
        tokens["operator"] = body["access_token"]
        return True

    tokens: dict[str, str] = {}
    wait_for("the gateway and identity", login)
    op = tokens["operator"]
    if token_file.exists():
        agent_api = os.environ.get("GPUAAS_AGENT_SERVER_URL", "http://lb:8002").rstrip("/")
        status, _ = _request("POST", f"{agent_api}/agent/heartbeat", token=token_file.read_text().strip())
        if status < 400:
            log(f"node token of {name} in {token_file} still works")
            return 0
    result: dict[str, object] = {}

    def enrol() -> bool:
        """Enrolled (or its token rotated); a 5xx or no answer (services still starting) is retried."""
        status, body = _request("POST", f"{api}/api/allocations/hosts", token=op, body={"name": name, "labels": {}})
        if status == 409:
            _, hosts = _request("GET", f"{api}/api/allocations/hosts", token=op)
            host = next(h for h in hosts if h["name"] == name)
            status, body = _request("POST", f"{api}/api/allocations/hosts/{host['host_id']}/node-token", token=op)
        if status == 0 or status >= 500:
            raise RuntimeError(f"{status} {body}")
        if status >= 300:
            sys.exit(f"enrolling {name} failed: {status} {body}")
        result.update(body)
        return True

    wait_for(f"enrolling {name}", enrol)
    body = result
    token_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, str(body["node_token"]).encode())
    finally:
        os.close(fd)
    log(f"enrolled {name}; node token written to {token_file}")
    return 0


def node_agent(args: list[str]) -> None:
    token_file = os.environ.get("GPUAAS_AGENT_NODE_TOKEN_FILE", "")
    if token_file:
        wait_for(f"the node token file {token_file} (enrol-node writes it)", lambda: Path(token_file).exists())
    exec_component("node-agent", args)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("help", "-h", "--help"):
        print(__doc__)
        return 0
    component, args = argv[0], argv[1:]
    if component == "healthcheck":
        return healthcheck()
    if component == "ready":
        return healthcheck("/readyz")
    load_secret_files()
    if component == "migrate":
        return migrate()
    if component == "enrol-node":
        return enrol_node(args[0] if args else os.environ.get("GPUAAS_ENROL_HOST_NAME", "compose-node-1"))
    if component == "node-agent":
        node_agent(args)
    if component.replace("-", "_") in HTTP_COMPONENTS:
        exec_component(component, args)
    sys.exit(f"unknown component {component!r}: run `help`")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
