"""Writing an app controller (docs/app-controllers.md): `Controller` with per-role handlers (`@on`), typed
config from the manifest, `TemporaryError` / `PermanentError`, stored state on the platform, a shell into
members, the `ReconcileLoop` (leases, rate-limited reconciles), the `gpuaas-controller` runner and a
`Harness` for tests against a real stack. One module per concern:

- `handlers`: `Controller`, `on`         - `context`: `OperationContext`, `ReconcileContext`
- `errors`: the exceptions               - `config`: the typed config model from the manifest's `inputs`
- `queue`: the rate-limited work queue   - `state`: `StoredState`
- `exec`: SSH into a member              - `loop`: `ReconcileLoop`
- `runner`: the `gpuaas-controller` CLI  - `harness`: tests against a real platform
- `memory`: `InMemoryHarness`, unit tests of the handlers with no stack (imported from there: not here)
"""

from gpuaas.sdk.controller.config import config_model, manifest_inputs
from gpuaas.sdk.controller.context import OperationContext, ReconcileContext
from gpuaas.sdk.controller.errors import Defer, LeaseLost, OperationFailed, PermanentError, TemporaryError
from gpuaas.sdk.controller.exec import AccessNotReady, CommandFailed, ExecResult, MemberShell
from gpuaas.sdk.controller.handlers import Controller, on
from gpuaas.sdk.controller.loop import ReconcileLoop
from gpuaas.sdk.controller.queue import Backoff, WorkQueue
from gpuaas.sdk.controller.state import StateConflict, StoredState

__all__ = [
    "AccessNotReady",
    "Backoff",
    "CommandFailed",
    "Controller",
    "Defer",
    "ExecResult",
    "LeaseLost",
    "MemberShell",
    "OperationContext",
    "OperationFailed",
    "PermanentError",
    "ReconcileContext",
    "ReconcileLoop",
    "StateConflict",
    "StoredState",
    "TemporaryError",
    "WorkQueue",
    "config_model",
    "manifest_inputs",
    "on",
]
