"""Billing's HTTP surface, by audience: tenants and projects (`users`), operators (`operators`)."""

from gpuaas.billing.api import operators, users

routers = [users.router, operators.router]
