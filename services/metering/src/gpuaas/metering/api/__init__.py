"""Metering's HTTP surface, by audience: app controllers report usage (`controllers`); tenants, projects
and operators read meters and usage (`users`)
and GPU-hours for charts (`insight`)."""

from gpuaas.metering.api import controllers, insight, users

routers = [controllers.router, users.router, insight.router]
