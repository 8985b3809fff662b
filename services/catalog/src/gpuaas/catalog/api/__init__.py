"""Catalog's HTTP surface, split by audience: `users` (catalog browsing), `publishers` (artifacts,
checks, promotion, app manifests), `operators` (entitlements, snapshots, seed). Thin routers: request
and response shapes are in `schemas`, rules and registry work in the service layer."""

from gpuaas.catalog.api import operators, publishers, users

routers = [users.router, publishers.router, operators.router]
