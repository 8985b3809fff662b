"""Billing's HTTP surface, by audience: tenants and projects (`users`), operators (`operators`),
chart series (`insight`)."""

from gpuaas.billing.api import insight, operators, users

routers = [users.router, insight.router, operators.router]
