"""`python -m gpuaas.gateway serve`: run the gateway with uvicorn (host/port: GPUAAS_GATEWAY_HOST/PORT)."""

from __future__ import annotations

import argparse

import uvicorn

from gpuaas.gateway.app import create_app, server_config
from gpuaas.gateway.settings import Settings
from gpuaas.kit.logging import configure_logging


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gpuaas.gateway")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run the gateway")
    parser.parse_args(argv)
    settings = Settings()
    configure_logging(settings.service_name, settings.log_level, settings.log_json)
    uvicorn.Server(server_config(create_app(settings), settings)).run()


if __name__ == "__main__":
    main()
