"""The `Controller` base class and per-role handlers (kopf's handlers per event, Juju's per-role charms):

    class Echo(Controller):
        config_schema = manifest_inputs("manifest.json")   # → ctx.config, a typed model

        @on("add", role="server")
        async def add_server(self, ctx): ...

        @on("add", role="worker")
        async def add_worker(self, ctx): ...

        @on("remove")                                      # any role
        async def remove(self, ctx): ...

        async def reconcile(self, ctx): ...                # timer per instance + on change

Lookup order for an operation of kind K on role R: `@on(K, role=R)`, `@on(K)`, a method named K; for
`recover` and `replace` without a handler of their own, the `add` handler of the role (bring a member up on
an allocation is the same work). No handler: the operation fails, saying so.

Drain: a `remove` first runs the role's `drain` handler (when the controller has one and the member was not
drained already), bounded by the operation's `params.drain_deadline_s` or `drain_deadline_s`; a drain that
fails or runs out of time is recorded in the remove's result (`drain`) and the member is removed anyway. A
`drain` operation of its own (`gpuaas apps drain`, or the platform's when the member's allocation is to be
preempted: `params.reason == "preemption"`, `params.deadline_at` the preemption's deadline) runs the handler
within its deadline and fails past it.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from pydantic import BaseModel

from gpuaas.sdk.controller.config import ConfigBase, config_model

if TYPE_CHECKING:
    from gpuaas.sdk.controller.context import OperationContext, ReconcileContext

KINDS = ("add", "drain", "remove", "replace", "recover")
ADD_LIKE = ("recover", "replace")
Handler = Callable[..., Awaitable[dict[str, Any] | None]]
F = TypeVar("F", bound=Callable[..., Any])


def on(kind: str, *, role: str | None = None) -> Callable[[F], F]:
    """Mark a method as the handler of operation `kind` (for members of `role`, or any role)."""
    if kind not in KINDS:
        raise ValueError(f"unknown operation kind {kind!r}; one of {', '.join(KINDS)}")

    def mark(fn: F) -> F:
        marks = getattr(fn, "__gpuaas_on__", [])
        fn.__dict__["__gpuaas_on__"] = [*marks, (kind, role)]
        return fn

    return mark


class Controller:
    """Subclass it; see the module docstring. Class attributes tune the loop for this controller."""

    config_schema: ClassVar[dict[str, Any] | None] = None  # the manifest's `inputs`
    Config: ClassVar[type[BaseModel] | None] = None  # or a hand-written model (wins over config_schema)
    reconcile_every_s: float = 30.0  # the timer per live instance (a class default; an instance may set its own)
    drain_deadline_s: float = 60.0  # how long a `remove` lets the role's `drain` handler run first
    _routes: ClassVar[dict[tuple[str, str | None], str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        routes: dict[tuple[str, str | None], str] = {}
        for klass in reversed(cls.__mro__):
            for name, member in vars(klass).items():
                for mark in getattr(member, "__gpuaas_on__", []):
                    routes[mark] = name
        cls._routes = routes
        if cls.Config is None and cls.config_schema is not None:
            cls.Config = config_model(cls.config_schema, f"{cls.__name__}Config")

    def handler_for(self, kind: str, role: str | None) -> Handler | None:
        for k in (kind, *(("add",) if kind in ADD_LIKE else ())):
            for key in ((k, role), (k, None)):
                if key in self._routes:
                    return getattr(self, self._routes[key])
            plain = getattr(type(self), k, None)
            if plain is not None and plain is not getattr(Controller, k, None):
                return getattr(self, k)
        return None

    def config_of(self, raw: dict[str, Any]) -> BaseModel:
        model = type(self).Config or ConfigBase
        return model.model_validate(raw)

    def legacy_reconcile(self) -> bool:
        """`reconcile(self, client, instance)`: the signature before ReconcileContext (still supported)."""
        return len(inspect.signature(self.reconcile).parameters) == 2

    async def reconcile(self, ctx: ReconcileContext) -> None:
        """Called per live instance on its timer (`reconcile_every_s`) and when it changes (a new version,
        an operation finished). Raise `TemporaryError(delay=)` to be called again sooner. Default: nothing."""

    # Handlers by kind, used when no `@on` handler matches (overriding them is the pre-`@on` way).
    async def add(self, ctx: OperationContext) -> dict[str, Any]:
        raise NotImplementedError

    async def drain(self, ctx: OperationContext) -> dict[str, Any]:
        raise NotImplementedError

    async def remove(self, ctx: OperationContext) -> dict[str, Any]:
        raise NotImplementedError

    async def replace(self, ctx: OperationContext) -> dict[str, Any]:
        raise NotImplementedError

    async def recover(self, ctx: OperationContext) -> dict[str, Any]:
        raise NotImplementedError
