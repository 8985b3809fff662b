"""The chart's migration job (deploy/helm/gpuaas/files/migrate.py) against a real Postgres, run the way the
hook Job runs it (`python -c <file>` with the environment the chart sets): it provisions the database, one role
and schema per service from each service's own URL, migrates every service, and can run again (every upgrade)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "gpuaas" / "files" / "migrate.py"
# Two of the six keep the test short (each migration is a process start): the first, and one whose package and
# Kubernetes names differ (app_runtime / app-runtime), with a URL-encoded password.
SERVICES = ["identity", "app_runtime"]


def service_url(admin_url: str, database: str, service: str, password: str) -> str:
    parts = urlsplit(admin_url)
    netloc = f"gpuaas_{service}:{password}@{parts.hostname}:{parts.port}"
    return urlunsplit(("postgresql+asyncpg", netloc, f"/{database}", "", ""))


def run_job(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT.read_text()],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


async def fetch(url: str, query: str, *args: Any) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        return await conn.fetch(query, *args)
    finally:
        await conn.close()


async def test_the_migration_job_provisions_and_migrates_every_service_and_runs_again(infra) -> None:
    database = f"chart_{uuid.uuid4().hex[:8]}"
    # The chart generates alphanumeric passwords; an operator's Secret may hold any URL-encoded one.
    passwords = {s: f"pw{uuid.uuid4().hex[:12]}" for s in SERVICES}
    passwords["app_runtime"] = "p%40ss%2Fw0rd"  # "p@ss/w0rd", URL-encoded as the URL in the Secret must be
    env = {
        "GPUAAS_MIGRATE_SERVICES": " ".join(SERVICES),
        "GPUAAS_MIGRATE_PROVISION": "true",
        "GPUAAS_DATABASE_URL": infra.admin_url,
        **{
            f"GPUAAS_{s.upper()}_DATABASE_URL": service_url(infra.admin_url, database, s, passwords[s])
            for s in SERVICES
        },
    }
    done = run_job(env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "migrate: all services migrated" in done.stdout

    for s in SERVICES:
        url = env[f"GPUAAS_{s.upper()}_DATABASE_URL"]
        # The role logs in with the password of its URL and owns its schema, migrated to a head.
        rows = await fetch(
            url,
            "SELECT n.nspname, r.rolname FROM pg_namespace n JOIN pg_roles r ON r.oid = n.nspowner "
            "WHERE n.nspname = $1",
            s,
        )
        assert [(r["nspname"], r["rolname"]) for r in rows] == [(s, f"gpuaas_{s}")]
        versions = await fetch(url, f"SELECT version_num FROM {s}.alembic_version")
        assert versions, f"{s} has no Alembic version"
        # Its outbox (a kit table) is there and empty.
        assert (await fetch(url, f"SELECT count(*) AS n FROM {s}.outbox"))[0]["n"] == 0
    # One role cannot read another's schema.
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await fetch(env["GPUAAS_APP_RUNTIME_DATABASE_URL"], "SELECT count(*) FROM identity.outbox")

    # Every upgrade runs the job again: nothing to do, nothing broken.
    again = run_job({**env, "GPUAAS_MIGRATE_SERVICES": "app_runtime"})
    assert again.returncode == 0, again.stdout + again.stderr

    # A URL with another role is refused before anything is changed.
    wrong = {**env, "GPUAAS_APP_RUNTIME_DATABASE_URL": env["GPUAAS_IDENTITY_DATABASE_URL"]}
    refused = run_job(wrong)
    assert refused.returncode != 0 and "must use the role gpuaas_app_runtime" in refused.stderr
