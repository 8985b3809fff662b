"""Agent settings (env prefix `GPUAAS_AGENT_`)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Literal

from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

log = logging.getLogger("gpuaas.node_agent")


class AgentSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPUAAS_AGENT_", extra="ignore")

    server_url: str = "http://127.0.0.1:8002"  # the allocations service (agents do not go through the gateway)
    # The node token (issued when the host is enrolled), read from this file: owned by the agent's user, mode
    # 0600 (a group/world-readable file, a link or another owner is refused).
    node_token_file: Path | None = None
    # Deprecated fallback when no token file is set: the token itself. Any process of the agent's user can read
    # /proc/<agent>/environ, so prefer GPUAAS_AGENT_NODE_TOKEN_FILE.
    node_token: SecretStr = SecretStr("")
    state_dir: Path = Path(".local/agent")
    # Declared GPUs when nvidia-smi is absent: "8xH100-80GB" or "4xA100-80GB:81920,2xL4" (count x model[:MiB]).
    gpus: str = ""
    nvidia_smi: str = "nvidia-smi"
    prefer_nvidia_smi: bool = True
    # Runtime driver: `container` (a podman container per allocation; isolates tenants), `process` (sessions
    # on the host as the agent's user; does not isolate tenants), `auto`: container when podman is installed.
    driver: Literal["auto", "container", "process"] = "auto"
    # The podman executable (container driver).
    podman: str = "podman"
    # CONTAINERS_CONF for podman (the local stack passes deploy/local/containers.conf); empty: podman's own.
    containers_conf: str = ""
    # Pull runtime images over plain HTTP / without TLS verification (a loopback registry only).
    registry_insecure: bool = False
    # Where the agent writes the CDI spec of its declared (fake) GPUs; real GPUs use the NVIDIA toolkit's spec.
    cdi_dir: Path = Path("/var/run/cdi")
    # The SSH endpoint the agent serves (asyncssh) for allocations when it runs unprivileged.
    ssh_bind: str = "127.0.0.1"
    ssh_port: int = 0  # 0: pick a free port once and keep it (state_dir/ssh_port)
    ssh_advertise_host: str = ""  # what users connect to; defaults to ssh_bind
    # Containment of project networks (firewall.py): internal destinations (private, link-local, metadata, LAN,
    # other podman networks) are always refused. Unset: every other destination is reachable through NAT; a
    # list: only these, as JSON, e.g. '["0.0.0.0/0:443", "203.0.113.0/24", "[2001:db8::/32]:80-90"]'.
    egress_allow: list[str] | None = None
    # The resolvers allocations may query (port 53) although they are internal; None: the host's resolv.conf.
    egress_resolvers: list[str] | None = None
    heartbeat_interval_s: float = 5.0
    long_poll_s: float = 20.0
    # Test hook: "release:1,provision:0" fails the first N tasks of a kind with an explicit reason.
    inject_failures: str = ""


class TokenFileUnsafe(RuntimeError):
    pass


def read_node_token(settings: AgentSettings) -> str:
    """The node token from its file; refuses a file that another user or group could read or swap."""
    path = settings.node_token_file
    if path is None:
        token = settings.node_token.get_secret_value()
        if token:
            log.warning("node token taken from GPUAAS_AGENT_NODE_TOKEN (deprecated): use GPUAAS_AGENT_NODE_TOKEN_FILE")
        return token
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TokenFileUnsafe(f"{path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise TokenFileUnsafe(f"{path} is owned by uid {st.st_uid}, not by the agent (uid {os.geteuid()})")
        if st.st_mode & 0o077:
            raise TokenFileUnsafe(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: it must be 0600 (owner only)")
        return os.read(fd, 4096).decode().strip()
    finally:
        os.close(fd)
