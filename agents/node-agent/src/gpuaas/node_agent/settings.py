"""Agent settings (env prefix `GPUAAS_AGENT_`)."""

from __future__ import annotations

from pathlib import Path

from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class AgentSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPUAAS_AGENT_", extra="ignore")

    server_url: str = "http://127.0.0.1:8002"  # the allocations service (agents do not go through the gateway)
    node_token: SecretStr = SecretStr("")
    state_dir: Path = Path(".local/agent")
    # Declared GPUs when nvidia-smi is absent: "8xH100-80GB" or "4xA100-80GB:81920,2xL4" (count x model[:MiB]).
    gpus: str = ""
    nvidia_smi: str = "nvidia-smi"
    prefer_nvidia_smi: bool = True
    # The SSH endpoint the agent serves (asyncssh) for allocations when it runs unprivileged.
    ssh_bind: str = "127.0.0.1"
    ssh_port: int = 0  # 0: pick a free port once and keep it (state_dir/ssh_port)
    ssh_advertise_host: str = ""  # what users connect to; defaults to ssh_bind
    heartbeat_interval_s: float = 5.0
    long_poll_s: float = 20.0
    # Test hook: "release:1,provision:0" fails the first N tasks of a kind with an explicit reason.
    inject_failures: str = ""
