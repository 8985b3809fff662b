"""What a handler gets: `OperationContext` for a member operation, `ReconcileContext` for a reconcile of
one instance. Both carry the instance's typed config, its stored state and a shell into its members."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

from pydantic import BaseModel

from gpuaas.sdk.client import ApiError, Client
from gpuaas.sdk.controller.errors import Defer, LeaseLost
from gpuaas.sdk.controller.exec import MemberShell
from gpuaas.sdk.controller.state import StoredState
from gpuaas.sdk.models import Claim, CredentialSecret, Instance, Member, Operation
from gpuaas.sdk.transport import Id


class Controller(Protocol):
    """What a context needs of `handlers.Controller` (named here so that the two modules do not import
    each other)."""

    def config_of(self, raw: dict[str, Any]) -> BaseModel: ...


# Who makes a context's shells when not SSH (`InMemoryHarness`): (instance id, allocation id) → a shell.
ShellFactory = Callable[[uuid.UUID, Id], MemberShell]


class _InstanceScoped:
    client: Client
    controller: Controller
    shells: ShellFactory | None
    _instance: Instance | None
    _state: StoredState | None
    _credential: CredentialSecret | None

    @property
    def instance_id(self) -> uuid.UUID:
        raise NotImplementedError

    def forget(self) -> None:
        """Drop what this context loaded (instance, state): the next call reads them again (a retry after a
        `TemporaryError` sees what changed meanwhile, say the state another operation wrote)."""
        self._instance = None
        self._state = None

    async def instance(self) -> Instance:
        if self._instance is None:
            self._instance = await self.client.instance(self.instance_id)
        return self._instance

    async def config(self) -> Any:
        """The instance's config as the controller's typed model (built from the manifest's `inputs`)."""
        return self.controller.config_of((await self.instance()).config)

    async def members(self) -> list[Member]:
        return await self.client.controller_members(self.instance_id)

    async def state(self) -> StoredState:
        """This instance's controller state on the platform (loaded once per context; `update` to change)."""
        if self._state is None:
            self._state = await StoredState.load(self.client, self.instance_id)
        return self._state

    async def event(self, kind: str, message: str = "", **data: Any) -> None:
        """An adapter event on the instance timeline (`controller.<kind>`)."""
        await self.client.report_event(self.instance_id, kind, message, **data)

    async def report(self, **fields: Any) -> Instance:
        """`status=`, `health=`, `runtime_detail=`, `app_version=` of the instance."""
        return await self.client.report_instance(self.instance_id, **fields)

    async def credential(self) -> CredentialSecret:
        """The instance's SSH key pair (fetched once per context, kept in memory only; each fetch is audited)."""
        if self._credential is None:
            self._credential = await self.client.fetch_credential(self.instance_id)
        return self._credential

    async def _private_key(self) -> str:
        return (await self.credential()).private_key

    def shell(self, allocation_id: Id, *, wait_s: float = 120.0) -> MemberShell:
        if self.shells is not None:
            return self.shells(self.instance_id, allocation_id)
        return MemberShell(self.client, self.instance_id, allocation_id, wait_s=wait_s, key_source=self._private_key)


@dataclass
class OperationContext(_InstanceScoped):
    client: Client
    claim: Claim
    app_slug: str
    controller: Controller = field(repr=False)
    attempt: int = 0  # how many times this claim's handler ran before (TemporaryError retries)
    member_detail: dict[str, Any] = field(default_factory=dict)  # sent with `complete` → the member's `detail`
    lease_s: int | None = None  # the lease the loop claimed with: progress keeps it
    shells: ShellFactory | None = field(default=None, repr=False)  # in-memory tests: no SSH
    _credential: CredentialSecret | None = field(default=None, repr=False)
    _instance: Instance | None = field(default=None, repr=False)
    _state: StoredState | None = field(default=None, repr=False)

    @property
    def operation(self) -> Operation:
        return self.claim.operation

    @property
    def instance_id(self) -> uuid.UUID:
        return self.operation.instance_id

    @property
    def lease_token(self) -> uuid.UUID:
        return self.claim.lease_token

    @property
    def role(self) -> str | None:
        return self.operation.component_key

    async def progress(self, message: str, percent: int | None = None) -> None:
        """Progress on the operation (and its timeline); also extends the lease by the length the loop claimed
        it with. Raises LeaseLost."""
        try:
            await self.client.heartbeat(
                self.operation.operation_id, self.lease_token, message=message, percent=percent, lease_s=self.lease_s
            )
        except ApiError as exc:
            if exc.code == "lease_lost":
                raise LeaseLost(str(exc)) from exc
            raise

    async def update_member_detail(self, **fields: Any) -> None:
        """Merge `fields` into `member_detail` and publish it on the member now (not only at completion), so
        that users and other replicas see it while the operation runs."""
        self.member_detail.update(fields)
        target = self.operation.target_member_id
        if target is None:
            raise ValueError("this operation names no member")
        await self.client.report_member(target, detail=dict(self.member_detail))

    def defer(self, reason: str = "", *, delay: float | None = None) -> NoReturn:
        """Give the operation back without it counting as an attempt (raises `Defer`; see there)."""
        raise Defer(reason, delay=delay)

    def shell(self, allocation_id: Id | None = None, *, wait_s: float = 120.0) -> MemberShell:
        """A shell into `allocation_id` (default: the operation's allocation); while it waits for access it
        reports progress, which keeps the lease."""
        target = allocation_id or self.operation.allocation_id
        if target is None:
            raise ValueError("this operation names no allocation: pass allocation_id")
        if self.shells is not None:
            return self.shells(self.instance_id, target)
        return MemberShell(
            self.client, self.instance_id, target, wait_s=wait_s, on_wait=self.progress, key_source=self._private_key
        )


@dataclass
class ReconcileContext(_InstanceScoped):
    client: Client
    controller: Controller
    instance_snapshot: Instance
    reason: str = "timer"  # "timer", "changed" (a new instance version) or "operation" (one finished)
    shells: ShellFactory | None = field(default=None, repr=False)
    _instance: Instance | None = field(default=None, repr=False)
    _state: StoredState | None = field(default=None, repr=False)
    _credential: CredentialSecret | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._instance = self.instance_snapshot

    @property
    def instance_id(self) -> uuid.UUID:
        return self.instance_snapshot.instance_id
