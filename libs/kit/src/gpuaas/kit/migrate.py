"""Run a service's migrations: the kit branch plus the service's own versions, to `heads`.

Programmatic Alembic config (no alembic.ini per service): the env lives in the kit, each
service contributes a `migrations/versions` folder.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import MetaData

from gpuaas.kit.db import to_asyncpg_url

KIT_MIGRATIONS = Path(__file__).parent / "migrations"


def alembic_config(url: str, schema: str, versions_dir: Path | None, metadata: MetaData | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(KIT_MIGRATIONS))
    locations = [str(KIT_MIGRATIONS / "versions")]
    if versions_dir is not None:
        locations.append(str(versions_dir))
    cfg.set_main_option("version_locations", " ".join(locations))
    cfg.set_main_option("path_separator", "space")
    cfg.attributes["url"] = to_asyncpg_url(url)
    cfg.attributes["schema"] = schema
    cfg.attributes["metadata"] = metadata
    return cfg


def upgrade(url: str, schema: str, versions_dir: Path | None, metadata: MetaData | None = None) -> None:
    command.upgrade(alembic_config(url, schema, versions_dir, metadata), "heads")
