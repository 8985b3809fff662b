"""`billing-export serve [--host H] [--port P]` | `billing-export asyncapi` (the consumer's AsyncAPI document)."""

from __future__ import annotations

import argparse
import json
import os

import uvicorn

from billing_export.app import Consumer, Settings, create_app


def main() -> None:
    parser = argparse.ArgumentParser(prog="billing-export")
    sub = parser.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve", help="consume gpuaas.billing.v1 and serve the exports")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=int(os.environ.get("BILLING_EXPORT_PORT", "8010")))
    sub.add_parser("asyncapi", help="print the consumer's AsyncAPI 3.0 document")
    args = parser.parse_args()
    if args.cmd == "asyncapi":
        os.environ.setdefault("BILLING_EXPORT_DATABASE_URL", "postgresql://unused")
        print(json.dumps(Consumer(Settings.from_env()).asyncapi(), indent=2, sort_keys=True))
        return
    uvicorn.run(create_app(), host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
