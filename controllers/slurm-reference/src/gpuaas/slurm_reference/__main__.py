"""Run the controller (the SDK's `gpuaas-controller run` with this adapter):

    GPUAAS_URL=https://gpuaas.example.com GPUAAS_CLIENT_ID=... GPUAAS_CLIENT_SECRET=... \
        python -m gpuaas.slurm_reference [--app-slug slurm-reference] [--lease-s 60] [--port 9464]

It authenticates as the project service account (client_credentials), claims the operations of its
app, checks each live instance every GPUAAS_HEALTH_EVERY_S (15) seconds, and runs until SIGTERM/SIGINT
(the operation in hand finishes). `/healthz` and `/metrics` are served on GPUAAS_HEALTH_PORT (off by default
here, so several controllers can share a machine in tests).
"""

from __future__ import annotations

import os
import sys

from gpuaas.sdk.controller import runner


def main() -> None:
    defaults = ["--app-slug", os.environ.get("GPUAAS_APP_SLUG", "slurm-reference")]
    defaults += ["--port", os.environ.get("GPUAAS_HEALTH_PORT", "0")]
    runner.main(["run", "gpuaas.slurm_reference.adapter:SlurmReference", *defaults, *sys.argv[1:]])


if __name__ == "__main__":
    main()
