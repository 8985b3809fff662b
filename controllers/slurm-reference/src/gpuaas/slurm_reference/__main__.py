"""Run the controller:

    GPUAAS_URL=https://gpuaas.example.com GPUAAS_CLIENT_ID=... GPUAAS_CLIENT_SECRET=... \
        python -m gpuaas.slurm_reference [--app-slug slurm-reference] [--lease-s 60]

It authenticates as the project service account (client_credentials), claims the operations of its
app, and runs until SIGTERM/SIGINT (the operation in hand finishes or its lease runs out).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from gpuaas.sdk import Client, ReconcileLoop
from gpuaas.slurm_reference.adapter import SlurmReference


async def run(url: str, client_id: str, client_secret: str, app_slug: str, lease_s: int, poll_s: float) -> None:
    client = Client(url, timeout_s=60)
    client.use_client_credentials(client_id, client_secret)
    loop = ReconcileLoop(
        client,
        app_slug=app_slug,
        controller=SlurmReference(health_every_s=float(os.environ.get("GPUAAS_HEALTH_EVERY_S", "15"))),
        lease_s=lease_s,
        poll_interval_s=poll_s,
        holder=os.environ.get("GPUAAS_CONTROLLER_HOLDER"),
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, loop.stop)
    try:
        await loop.run()
    finally:
        await client.aclose()


def main() -> None:
    p = argparse.ArgumentParser(prog="gpuaas-slurm-reference", description=__doc__)
    p.add_argument("--url", default=os.environ.get("GPUAAS_URL", "http://127.0.0.1:8000"))
    p.add_argument("--app-slug", default=os.environ.get("GPUAAS_APP_SLUG", "slurm-reference"))
    p.add_argument("--lease-s", type=int, default=int(os.environ.get("GPUAAS_LEASE_S", "60")))
    p.add_argument("--poll-s", type=float, default=float(os.environ.get("GPUAAS_POLL_S", "1.0")))
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    for noisy in ("asyncssh", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    asyncio.run(
        run(
            args.url,
            os.environ["GPUAAS_CLIENT_ID"],
            os.environ["GPUAAS_CLIENT_SECRET"],
            args.app_slug,
            args.lease_s,
            args.poll_s,
        )
    )


if __name__ == "__main__":
    main()
