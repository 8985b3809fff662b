"""Where the platform is and who is signed in.

The endpoint comes from, in order: `--url`, `GPUAAS_URL`, the config file's `url`, the gateway recorded in
`.local/stack.json` (found in the working directory or above it: a `make run` stack), else
http://127.0.0.1:8000. The config file (`GPUAAS_CONFIG`, default `~/.config/gpuaas/config.json`, mode 0600)
keeps the tokens of the last login and the selected project.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"


def config_path() -> Path:
    if path := os.environ.get("GPUAAS_CONFIG"):
        return Path(path)
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "gpuaas" / "config.json"


def known_hosts_path() -> Path:
    """The SSH host keys the platform pinned for the allocations this CLI opened (`alloc ssh`), beside the config."""
    return config_path().parent / "known_hosts"


def remember_host_key(line: str) -> Path:
    """Put `line` (`[host]:port <type> <base64>`) in the known_hosts file, replacing the endpoint's earlier key
    (a host re-enrolled with a new key is re-pinned by the platform, not by the user's say-so)."""
    path = known_hosts_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    endpoint = line.split()[0]
    try:
        kept = [k for k in path.read_text().splitlines() if k.strip() and k.split()[0] != endpoint]
    except OSError:
        kept = []
    path.write_text("\n".join([*kept, line]) + "\n")
    return path


@dataclass
class Config:
    url: str | None = None
    access_token: str | None = None
    refresh_token: str | None = None
    email: str | None = None
    project_id: str | None = None

    @classmethod
    def load(cls) -> Config:
        path = config_path()
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return cls()
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def save(self) -> None:
        path = config_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f, indent=2)
        tmp.replace(path)


def stack_json(start: Path | None = None) -> dict[str, Any] | None:
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / ".local" / "stack.json"
        if candidate.is_file():
            try:
                return json.loads(candidate.read_text())
            except (OSError, ValueError):
                return None
    return None


def resolve_url(flag: str | None, config: Config, start: Path | None = None) -> str:
    if flag:
        return flag.rstrip("/")
    if env := os.environ.get("GPUAAS_URL"):
        return env.rstrip("/")
    if config.url:
        return config.url.rstrip("/")
    state = stack_json(start)
    gateway: dict[str, Any] = (state or {}).get("gateway") or {}
    if url := gateway.get("url"):
        return str(url).rstrip("/")
    return DEFAULT_URL
