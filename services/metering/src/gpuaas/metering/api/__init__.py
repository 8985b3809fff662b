"""Metering's HTTP surface, by audience: app controllers report usage (`controllers`); tenants, projects
and operators read meters and usage (`users`)."""

from gpuaas.metering.api import controllers, users

routers = [controllers.router, users.router]
