"""Render the nginx edge (deploy/nginx/gpuaas-edge.conf.template) into a complete nginx.conf.

    uv run python scripts/render_edge.py --gateway HOST:PORT --upstream identity=HOST:PORT [...] \
        [--listen 8080] [--state-dir /tmp/gpuaas-edge] [--max-body-bytes 1000000] [--rate-per-s 50] [--burst 100] \
        [-o nginx.conf]

Only the template's `${EDGE_*}` placeholders are filled (nginx's own `$variables` are left alone); a placeholder
without a value is an error. Services not given (`--upstream name=host:port`) point at 127.0.0.1:9, which refuses
connections: their /api/<service>/ paths answer 502. The Helm chart's edge ConfigMap fills the same placeholders.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent.parent / "deploy" / "nginx" / "gpuaas-edge.conf.template"
# The services routed at /api/<segment>/ (the gateway's DEFAULT_UPSTREAMS; segment = name with "_" -> "-").
SERVICES = ("identity", "allocations", "catalog", "app-runtime", "metering", "billing")
UNROUTED = "127.0.0.1:9"
_PLACEHOLDER = re.compile(r"\$\{(EDGE_[A-Z_]+)\}")


def render(values: dict[str, str], template: str | None = None) -> str:
    text = TEMPLATE.read_text() if template is None else template
    missing = sorted({m for m in _PLACEHOLDER.findall(text) if m not in values})
    if missing:
        raise ValueError(f"no value for {', '.join(missing)}")
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def edge_values(
    *,
    gateway: str,
    upstreams: dict[str, str],
    listen: str = "8080",
    state_dir: str = "/tmp/gpuaas-edge",
    max_body_bytes: int = 1_000_000,
    rate_per_s: int = 50,
    burst: int = 100,
) -> dict[str, str]:
    """The placeholder values; `upstreams` maps a service (identity, app-runtime or app_runtime, ...) to host:port."""
    given = {name.replace("_", "-"): addr for name, addr in upstreams.items()}
    unknown = sorted(set(given) - set(SERVICES))
    if unknown:
        raise ValueError(f"unknown services {unknown}; routed: {list(SERVICES)}")
    values = {
        "EDGE_LISTEN": listen,
        "EDGE_STATE_DIR": state_dir,
        "EDGE_GATEWAY": gateway,
        "EDGE_MAX_BODY_BYTES": str(max_body_bytes),
        "EDGE_RATE_PER_S": str(rate_per_s),
        "EDGE_BURST": str(burst),
    }
    for service in SERVICES:
        values["EDGE_" + service.replace("-", "_").upper()] = given.get(service, UNROUTED)
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateway", required=True, help="the Python gateway, host:port")
    parser.add_argument("--upstream", action="append", default=[], help="service=host:port (repeat)")
    parser.add_argument("--listen", default="8080", help="nginx `listen` argument, e.g. 8080 or 127.0.0.1:8080")
    parser.add_argument("--state-dir", default="/tmp/gpuaas-edge", help="writable: pid file and temp paths")
    parser.add_argument("--max-body-bytes", type=int, default=1_000_000)
    parser.add_argument("--rate-per-s", type=int, default=50)
    parser.add_argument("--burst", type=int, default=100)
    parser.add_argument("-o", "--output", type=Path, help="default: stdout")
    args = parser.parse_args(argv)
    upstreams = dict(u.split("=", 1) for u in args.upstream)
    text = render(
        edge_values(
            gateway=args.gateway,
            upstreams=upstreams,
            listen=args.listen,
            state_dir=args.state_dir,
            max_body_bytes=args.max_body_bytes,
            rate_per_s=args.rate_per_s,
            burst=args.burst,
        )
    )
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
