"""Identity's background loop: re-verify the DNS proofs of owned email domains (service/domain_proofs.py)."""

from __future__ import annotations

from gpuaas.identity.runtime import IdentityRuntime
from gpuaas.identity.service import domain_proofs
from gpuaas.identity.settings import Settings
from gpuaas.kit.app import KitRuntime
from gpuaas.kit.loops import run_periodically


async def reverify_domains(kit: KitRuntime) -> None:
    """Every `domain_reverify_every_s` (0: never), one batch of due proofs looked up again."""
    settings = kit.settings_as(Settings)
    if settings.domain_reverify_every_s <= 0:
        return
    resolver = kit.state_as(IdentityRuntime).resolver

    async def step() -> bool:
        await domain_proofs.reverify_due(kit.sessions, settings, resolver)
        return False  # one batch a round: a slow or failing DNS never makes the loop spin

    await run_periodically(kit, "domain_reverify", settings.domain_reverify_every_s, step)
