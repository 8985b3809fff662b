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
from datetime import datetime

import uvicorn

from gpuaas.kit.app import ServiceSpec, create_app
from gpuaas.kit.db import create_engine, session_factory
from gpuaas.kit.migrate import upgrade
from gpuaas.kit.relay import replay


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

        async def _replay() -> int:
            engine = create_engine(url, settings.schema, pool_size=1)
            try:
                return await replay(session_factory(engine), args.since, args.until)
            finally:
                await engine.dispose()

        print(f"requeued {asyncio.run(_replay())} outbox rows")
    else:
        uvicorn.run(
            create_app(settings, spec),
            host=settings.host,
            port=settings.port,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=15,
        )
