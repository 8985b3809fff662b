"""The app_runtime service's runtime state, built once at startup (`kit.state`) and read with
`kit.state_as(AppRuntimeState)`."""

from __future__ import annotations

from dataclasses import dataclass

from gpuaas.app_runtime.custody import Custody, make_custody
from gpuaas.app_runtime.settings import Settings
from gpuaas.kit.app import KitRuntime


@dataclass
class AppRuntimeState:
    # Where access credentials' private keys are kept (this schema, envelope-encrypted, or Vault).
    custody: Custody


async def start_runtime_state(kit: KitRuntime) -> None:
    """on_startup hook: the custody backend the settings choose."""
    kit.state = AppRuntimeState(custody=make_custody(kit.settings_as(Settings), kit.keyring))
