"""Write a new Alembic revision for a service by autogenerate, against a scratch embedded Postgres.

    uv run python scripts/new_migration.py <service> "<message>"

It migrates a fresh schema to the service's current head, compares with the service's `metadata`
(SQLAlchemy tables in models.py) and writes `<date>_<service>_<NNNN>_<slug>.py` into the service's
migrations/versions. Read the result before committing: autogenerate misses renames, server-side
functions and data migrations. Applied migrations are never edited; always add a new one.
"""

from __future__ import annotations

import asyncio
import importlib
import re
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from alembic import command
from alembic.script import ScriptDirectory

from gpuaas.devstack.infra import EmbeddedPostgres, free_port
from gpuaas.kit import provision
from gpuaas.kit.migrate import alembic_config


def main(service: str, message: str) -> None:
    spec = importlib.import_module(f"gpuaas.{service}.app").SPEC
    if spec.metadata is None or spec.versions_dir is None:
        sys.exit(f"{service}: SPEC needs `metadata` and `versions_dir`")
    root = Path(tempfile.mkdtemp(prefix="gpuaas-autogen-"))
    root.chmod(0o755)
    pg = EmbeddedPostgres(root / "pg", port=free_port())
    pg.start()
    try:
        asyncio.run(provision.ensure_database(pg.admin_url, "gpuaas"))
        url = asyncio.run(provision.ensure_service_schema(pg.url("gpuaas"), service, "autogen"))
        cfg = alembic_config(url, service, spec.versions_dir, spec.metadata)
        command.upgrade(cfg, "heads")
        script = ScriptDirectory.from_config(cfg)
        head = script.get_revision(f"{service}@head")
        number = int(head.revision.rsplit("_", 1)[1]) + 1 if head else 1
        rev_id = f"{service}_{number:04d}"
        slug = re.sub(r"[^a-z0-9]+", "_", message.lower()).strip("_")[:40]
        command.revision(
            cfg, message, autogenerate=True, rev_id=rev_id, version_path=str(spec.versions_dir), head=f"{service}@head"
        )
        generated = spec.versions_dir / f"{rev_id}_{slug}.py"
        target = spec.versions_dir / f"{datetime.now(UTC):%Y_%m_%d}_{rev_id}_{slug}.py"
        candidates = list(spec.versions_dir.glob(f"{rev_id}_*.py"))
        (candidates[0] if candidates else generated).rename(target)
        print(target)
    finally:
        pg.stop()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
