"""gpuaas.sdk: typed HTTP client of the public API (through the gateway), for the CLI, app controllers
and tests, and the controller reconcile loop (claim → act → report)."""

from gpuaas.sdk.client import ApiError, Client
from gpuaas.sdk.controller import Controller, LeaseLost, OperationContext, OperationFailed, ReconcileLoop

__all__ = ["ApiError", "Client", "Controller", "LeaseLost", "OperationContext", "OperationFailed", "ReconcileLoop"]
