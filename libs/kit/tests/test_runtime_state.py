"""KitRuntime.state_as / settings_as: a service's own runtime objects and settings, typed; and the `Kit`
router dependency that reaches them."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest
from fastapi import FastAPI, Request

from gpuaas.kit.app import Kit, kit_of
from gpuaas.kit.settings import ServiceSettings, service_config

from .runtime_stub import bare_kit


@dataclass
class ClosersState:
    wakeups: int = 0


@dataclass
class OtherState:
    name: str = "other"


class ClosersSettings(ServiceSettings):
    model_config = service_config("closers")
    closer_interval_s: float = 7.5


class UnrelatedSettings(ServiceSettings):
    model_config = service_config("unrelated")


def test_state_as_returns_the_state_set_at_startup_typed() -> None:
    state = ClosersState(wakeups=3)
    kit = bare_kit(state=state)
    got = kit.state_as(ClosersState)
    assert got is state and got.wakeups == 3


def test_state_as_refuses_another_type_and_a_missing_state() -> None:
    with pytest.raises(RuntimeError, match="runtime state is ClosersState, not OtherState"):
        bare_kit(state=ClosersState()).state_as(OtherState)
    with pytest.raises(RuntimeError, match="runtime state is NoneType, not ClosersState"):
        bare_kit().state_as(ClosersState)  # no on_startup hook set it


def test_settings_as_returns_the_service_settings_typed() -> None:
    settings = ClosersSettings(service_name="closers")
    kit = bare_kit(settings=settings)
    assert kit.settings_as(ClosersSettings).closer_interval_s == 7.5
    assert kit.settings_as(ServiceSettings) is settings  # the base class is a settings class too


def test_settings_as_refuses_another_settings_class() -> None:
    kit = bare_kit(settings=ClosersSettings(service_name="closers"))
    with pytest.raises(RuntimeError, match="settings are ClosersSettings, not UnrelatedSettings"):
        kit.settings_as(UnrelatedSettings)
    with pytest.raises(RuntimeError, match="not ClosersSettings"):
        bare_kit().settings_as(ClosersSettings)  # plain ServiceSettings


async def test_the_kit_dependency_and_kit_of_give_the_app_runtime() -> None:
    app = FastAPI()
    runtime = bare_kit(state=ClosersState(wakeups=5))
    app.state.kit = runtime

    @app.get("/wakeups")
    async def wakeups(kit: Kit) -> dict[str, object]:
        return {"wakeups": kit.state_as(ClosersState).wakeups, "same": kit is runtime}

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://svc") as client:
        r = await client.get("/wakeups")
    assert r.json() == {"wakeups": 5, "same": True}

    # Code outside a router signature (an exception handler, a middleware) uses kit_of(request).
    assert kit_of(Request({"type": "http", "app": app})) is runtime
