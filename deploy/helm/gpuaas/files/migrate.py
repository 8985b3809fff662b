"""The chart's migration job: provision (optional), then every service's Alembic upgrade, in order.

Run by the pre-install/pre-upgrade hook Job as `python -c <this file>` in the platform image; tested
against a real Postgres by tests/ops/test_chart_migrate.py. Environment:

- GPUAAS_MIGRATE_SERVICES: the services, in order (e.g. "identity allocations catalog app_runtime ...");
- GPUAAS_<SERVICE>_DATABASE_URL: each service's own URL (role gpuaas_<service>, its password);
- GPUAAS_MIGRATE_PROVISION: "true" to create the database, roles and schemas first (idempotent), with
- GPUAAS_DATABASE_URL: a superuser URL of the server (any database; only for provisioning).

Provisioning takes each role's password from the service's own URL, so the two never disagree.
"""

import asyncio
import os
import subprocess
import sys
from urllib.parse import unquote, urlsplit, urlunsplit


def _service_url(service: str) -> str:
    name = f"GPUAAS_{service.upper()}_DATABASE_URL"
    url = os.environ.get(name)
    if not url:
        sys.exit(f"migrate: {name} is not set")
    return url


async def _provision(services: list[str]) -> None:
    from gpuaas.kit.provision import ensure_database, ensure_service_schema, role_name

    admin = os.environ.get("GPUAAS_DATABASE_URL")
    if not admin:
        sys.exit("migrate: provisioning needs GPUAAS_DATABASE_URL (a superuser URL)")
    admin_parts = urlsplit(admin)
    urls = {service: urlsplit(_service_url(service)) for service in services}
    for service, parts in urls.items():  # every URL checked before anything is changed
        if parts.username != role_name(service):
            sys.exit(f"migrate: {service}'s URL must use the role {role_name(service)}, not {parts.username!r}")
    for service, parts in urls.items():
        database = parts.path.lstrip("/")
        await ensure_database(admin, database)
        # The same server, the service's database, as the superuser.
        admin_db = urlunsplit((admin_parts.scheme, admin_parts.netloc, f"/{database}", admin_parts.query, ""))
        await ensure_service_schema(admin_db, service, unquote(parts.password or ""))
        print(f"migrate: provisioned role {role_name(service)} and schema {service} in {database}", flush=True)


def main() -> None:
    services = os.environ.get("GPUAAS_MIGRATE_SERVICES", "").split()
    if not services:
        sys.exit("migrate: GPUAAS_MIGRATE_SERVICES is empty")
    if os.environ.get("GPUAAS_MIGRATE_PROVISION", "").lower() == "true":
        asyncio.run(_provision(services))
    for service in services:
        _service_url(service)
        print(f"migrate: {service}", flush=True)
        done = subprocess.run([sys.executable, "-m", f"gpuaas.{service}", "migrate"], check=False)
        if done.returncode != 0:
            sys.exit(f"migrate: {service} failed ({done.returncode}); later services were not migrated")
    print("migrate: all services migrated", flush=True)


main()
