"""gpuaas.sdk: typed HTTP client of the public API (through the gateway), for the CLI, app controllers
and tests, and the controller toolkit (`gpuaas.sdk.controller`: handlers, loop, runner, harness)."""

from gpuaas.sdk.client import ApiError, Client
from gpuaas.sdk.controller import (
    Controller,
    LeaseLost,
    OperationContext,
    OperationFailed,
    PermanentError,
    ReconcileContext,
    ReconcileLoop,
    TemporaryError,
    on,
)

__all__ = [
    "ApiError",
    "Client",
    "Controller",
    "LeaseLost",
    "OperationContext",
    "OperationFailed",
    "PermanentError",
    "ReconcileContext",
    "ReconcileLoop",
    "TemporaryError",
    "on",
]
