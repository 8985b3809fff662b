"""The allocations service's runtime state (`kit.state`), set at startup and read with
`kit.state_as(AllocationsRuntime)`: the per-host task wake-ups and the terminal's SSH certificate authority."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

import asyncssh

from gpuaas.allocations import service
from gpuaas.allocations.service import overlay
from gpuaas.allocations.settings import Settings
from gpuaas.kit.app import KitRuntime


class Wakeups:
    """Per-host events set when a task is queued for that host (wakes its agent's long-poll)."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def event(self, host_id: uuid.UUID | str) -> asyncio.Event:
        return self._events.setdefault(str(host_id), asyncio.Event())

    def notify(self, host_id: uuid.UUID | str | None) -> None:
        if host_id is not None:
            self.event(host_id).set()


@dataclass
class SshCa:
    """The platform's SSH CA: each browser terminal session gets a fresh key and a short-lived certificate."""

    key: asyncssh.SSHKey

    @property
    def public(self) -> str:
        return self.key.export_public_key().decode().strip()

    def session_credentials(
        self, username: str, ttl_s: int, key_id: str
    ) -> tuple[asyncssh.SSHKey, asyncssh.SSHCertificate]:
        user_key = asyncssh.generate_private_key("ssh-ed25519")
        now = int(time.time())
        cert = self.key.generate_user_certificate(
            user_key,
            key_id,
            principals=[username],
            valid_after=now - 30,
            valid_before=now + ttl_s,
            permit_x11_forwarding=False,
            permit_agent_forwarding=False,
            permit_port_forwarding=False,
        )
        return user_key, cert


@dataclass
class AllocationsRuntime:
    wakeups: Wakeups = field(default_factory=Wakeups)
    # Set when capacity or demand changed (NOTIFY allocations_admission, any replica): the admission loop runs.
    admission_poke: asyncio.Event = field(default_factory=asyncio.Event)
    ssh_ca: SshCa | None = None

    @property
    def terminal_ca(self) -> SshCa:
        if self.ssh_ca is None:
            raise RuntimeError("the terminal CA is loaded at startup")
        return self.ssh_ca


async def start_runtime(kit: KitRuntime) -> None:
    """Startup hook: the overlay pool, the wake-ups, and the platform CA (created once: the first replica's key
    wins)."""
    settings = kit.settings_as(Settings)
    overlay.configure(overlay.OverlayPool.parse(settings.overlay_pool, settings.overlay_vni_base))
    state = AllocationsRuntime()
    kit.state = state
    candidate = asyncssh.generate_private_key("ssh-ed25519")
    async with kit.sessions() as session, session.begin():
        private_key = await service.terminal_ca_private_key(
            session, candidate.export_private_key().decode(), candidate.export_public_key().decode()
        )
    state.ssh_ca = SshCa(asyncssh.import_private_key(private_key))
