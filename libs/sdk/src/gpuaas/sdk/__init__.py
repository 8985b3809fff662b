"""gpuaas.sdk: typed HTTP client of the public API (through the gateway), for the CLI, app controllers
and tests."""

from gpuaas.sdk.client import ApiError, Client

__all__ = ["ApiError", "Client"]
