"""A small async client of the public API, one typed method per call (grouped by service in the modules
beside this one). Errors come back as `ApiError` carrying the problem's code."""

from __future__ import annotations

from gpuaas.sdk.allocations import AllocationsApi
from gpuaas.sdk.app_runtime import AppRuntimeApi
from gpuaas.sdk.billing import BillingApi
from gpuaas.sdk.catalog import CatalogApi
from gpuaas.sdk.identity import IdentityApi
from gpuaas.sdk.transport import ApiError

__all__ = ["ApiError", "Client"]


class Client(IdentityApi, AllocationsApi, CatalogApi, AppRuntimeApi, BillingApi):
    """Every API group on one connection; see `Transport` for tokens, refresh and test transports."""
