"""A KitRuntime without a database or broker, for unit tests of what only reads its plain fields."""

from __future__ import annotations

from typing import Any

from gpuaas.kit.app import KitRuntime, ServiceSpec
from gpuaas.kit.settings import ServiceSettings


def bare_kit(settings: ServiceSettings | None = None, state: object | None = None) -> KitRuntime:
    none: Any = None  # engine, sessions, metrics, verifier, subscriptions: never touched by these tests
    return KitRuntime(
        settings=settings or ServiceSettings(service_name="unit"),
        spec=ServiceSpec(name="unit", settings_cls=ServiceSettings),
        engine=none,
        sessions=none,
        metrics=none,
        verifier=none,
        subscriptions=none,
        state=state,
    )
