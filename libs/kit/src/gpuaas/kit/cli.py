"""Each service's command line: `python -m gpuaas.<service> serve | migrate | replay`.

- serve: run the API, relay and consumers (uvicorn).
- migrate: Alembic upgrade of the kit branch and the service's own versions (a separate step; the
  runner calls it before starting services).
- replay --since ISO [--until ISO]: requeue published outbox rows of a time range (after a broker
  lost its log); the running relay publishes them again and consumers dedupe.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from gpuaas.kit.migrate import upgrade

if TYPE_CHECKING:
    from gpuaas.kit.app import ServiceSpec


def run(package: str, argv: list[str] | None = None) -> None:
    """`python -m <package> ...` of a service. `migrate` imports only the service's `settings` and `models`
    (its `Settings`, `metadata` and the `migrations/versions` beside them, as its SPEC names them): a stack start
    migrates every service in parallel processes, and importing each whole app for it cost ~5 s of CPU apiece.
    Every other command imports the app and its SPEC."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["migrate"] and len(args) == 1:
        settings = importlib.import_module(f"{package}.settings").Settings()
        models = importlib.import_module(f"{package}.models")
        versions = Path(str(models.__file__)).parent / "migrations" / "versions"
        upgrade(settings.database_url.get_secret_value(), settings.schema, versions, models.metadata)
        return
    main(importlib.import_module(f"{package}.app").SPEC, args)


def main(spec: ServiceSpec, argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"gpuaas.{spec.name}")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("serve", help="run the service")
    sub.add_parser("migrate", help="apply database migrations")
    rp = sub.add_parser("replay", help="requeue published outbox rows of a time range")
    rp.add_argument("--since", required=True, type=datetime.fromisoformat)
    rp.add_argument("--until", type=datetime.fromisoformat)
    args = parser.parse_args(argv)
    settings = spec.settings_cls()
    url = settings.database_url.get_secret_value()

    if args.command == "migrate":
        upgrade(url, settings.schema, spec.versions_dir, spec.metadata)
    elif args.command == "replay":
        from gpuaas.kit.db import create_engine, session_factory
        from gpuaas.kit.relay import replay

        async def _replay() -> int:
            engine = create_engine(url, settings.schema, pool_size=1)
            try:
                return await replay(session_factory(engine), args.since, args.until)
            finally:
                await engine.dispose()

        print(f"requeued {asyncio.run(_replay())} outbox rows")
    else:
        import uvicorn

        from gpuaas.kit.app import create_app

        uvicorn.run(
            create_app(settings, spec),
            host=settings.host,
            port=settings.port,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=15,
        )
