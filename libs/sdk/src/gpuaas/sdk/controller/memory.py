"""Unit-test a controller's handlers with no stack (Juju ops' `Harness`): an in-memory model of the platform's
controller API behind a real `Client` (an httpx mock transport), driven by the real `ReconcileLoop`, so that
leases, retries, `Defer`, drain-before-remove, member detail and stored state behave as against the platform.
Shells are scripted: `on_shell(fn)` answers each command (default: exit 0, no output) and `shell_calls` records
them.

    h = InMemoryHarness(EchoController(), manifest=MANIFEST)
    h.on_shell(lambda call: ExecResult("PORT=8000\\n", "", 0) if "http.server" in call.input else ExecResult("", "", 0))
    inst = h.deploy({"greeting": "hi"}, server=1, worker=2)   # an add per member, the first role first
    await h.settle()                                            # handle what can be claimed, then reconcile
    assert h.instance(inst).status == "running"
    await h.decommission(inst)

The model is the platform's rules in small: operations are handed out oldest first in the manifest's role
order (`after`), one open operation per member, a deferred operation is offered again once its instance
changes, the instance's status follows its members (a member leaving by plan is not a loss), and it is
`decommissioned` once every `remove` reported a verified teardown. What it does not model: authorization,
versions and If-Match, leases running out by time, the timeline's system entries, allocations beyond an
address. The real-stack `Harness` (harness.py) covers those.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from gpuaas.sdk.client import Client
from gpuaas.sdk.controller.exec import ExecResult, MemberShell
from gpuaas.sdk.controller.handlers import Controller
from gpuaas.sdk.controller.loop import ReconcileLoop
from gpuaas.sdk.transport import Id

BRINGS_UP = ("add", "replace", "recover")
TAKES_AWAY = ("remove", "drain")
OPEN = ("pending", "claimed", "in_progress")


def _now() -> str:
    return datetime.now(UTC).isoformat()


@dataclass
class ShellCall:
    instance_id: uuid.UUID
    allocation_id: uuid.UUID
    command: str
    input: str


class _Shell(MemberShell):
    def __init__(self, harness: InMemoryHarness, instance_id: uuid.UUID, allocation_id: Id) -> None:
        super().__init__(harness.client, instance_id, allocation_id)
        self.harness = harness

    async def run(self, command: str, **kwargs: Any) -> ExecResult:
        from gpuaas.sdk.controller.exec import CommandFailed

        call = ShellCall(
            uuid.UUID(str(self.instance_id)), uuid.UUID(str(self.allocation_id)), command, kwargs.get("input") or ""
        )
        self.harness.shell_calls.append(call)
        result = self.harness.shell_answer(call)
        if kwargs.get("check", True) and not result.ok:
            raise CommandFailed(command, result)
        return result


@dataclass
class _Instance:
    data: dict[str, Any]
    state: dict[str, Any] = field(default_factory=dict)
    state_version: int = 0


class InMemoryHarness:
    def __init__(
        self,
        controller: Controller,
        *,
        manifest: dict[str, Any] | None = None,
        app_slug: str | None = None,
        **loop_kw: Any,
    ) -> None:
        self.controller = controller
        self.manifest = manifest or {"slug": app_slug or "app", "version": "1.0", "roles": [{"key": "worker"}]}
        self.app_slug = app_slug or str(self.manifest.get("slug") or "app")
        self.roles: list[dict[str, Any]] = list(self.manifest.get("roles") or [])
        self.project_id = uuid.uuid4()
        self.instances: dict[uuid.UUID, _Instance] = {}
        self.members_: dict[uuid.UUID, dict[str, Any]] = {}
        self.operations: dict[uuid.UUID, dict[str, Any]] = {}  # in creation order
        self.events: list[dict[str, Any]] = []  # the controller's timeline events
        self.shell_calls: list[ShellCall] = []
        self.shell_answer: Callable[[ShellCall], ExecResult] = lambda call: ExecResult("", "", 0)
        self.client = Client("http://in-memory", "harness", transport=httpx.MockTransport(self._route))
        self._seq = 0
        self.loop = ReconcileLoop(self.client, app_slug=self.app_slug, controller=controller, **loop_kw)
        self.loop.shells = self._shell

    def _shell(self, instance_id: uuid.UUID, allocation_id: Id) -> MemberShell:
        return _Shell(self, instance_id, allocation_id)

    def on_shell(self, answer: Callable[[ShellCall], ExecResult | str]) -> None:
        """How shells answer: an `ExecResult`, or a string (stdout, exit 0)."""

        def wrapped(call: ShellCall) -> ExecResult:
            got = answer(call)
            return ExecResult(got, "", 0) if isinstance(got, str) else got

        self.shell_answer = wrapped

    async def aclose(self) -> None:
        await self.client.aclose()

    # ------------------------------------------------------------------------------------ what a user does

    def deploy(self, config: dict[str, Any] | None = None, **members_per_role: int) -> uuid.UUID:
        """An instance with an `add` per member (`server=1, worker=2`; default one of the first role), in the
        manifest's role order."""
        iid = uuid.uuid4()
        at = _now()
        self.instances[iid] = _Instance(
            {
                "instance_id": str(iid),
                "tenant_id": str(uuid.uuid4()),
                "project_id": str(self.project_id),
                "name": "harness",
                "app_slug": self.app_slug,
                "app_version": str(self.manifest.get("version") or "1.0"),
                "manifest_id": str(uuid.uuid4()),
                "artifact_digest": "sha256:" + "0" * 64,
                "status": "created",
                "status_changed_at": at,
                "placement_intent": {"mode": "split"},
                "config": config or {},
                "runtime_detail": {},
                "health": {"status": "unknown", "message": ""},
                "failure_reason": None,
                "decommission": None,
                "desired_manifest_id": None,
                "desired_app_version": None,
                "previous_manifest_id": None,
                "version": 1,
                "created_at": at,
            }
        )
        keys = [r["key"] for r in self.roles] or ["worker"]
        wanted = members_per_role or {keys[0]: 1}
        for role in sorted(wanted, key=lambda r: keys.index(r) if r in keys else len(keys)):
            for _ in range(wanted[role]):
                self.add(iid, role)
        return iid

    def add(self, instance_id: uuid.UUID, role: str, allocation_id: uuid.UUID | None = None) -> uuid.UUID:
        """Request an `add` of a `role` member (on a new allocation unless given); returns the operation id."""
        member_id = uuid.uuid4()
        op = self._operation(instance_id, "add", member_id, role, allocation_id or uuid.uuid4(), {})
        op["result_member_id"] = str(member_id)
        self._reoffer(instance_id)
        self.members_[member_id] = {
            "member_id": str(member_id),
            "instance_id": str(instance_id),
            "component_key": role,
            "allocation_id": op["allocation_id"],
            "status": "pending",
            "status_changed_at": _now(),
            "last_operation_id": op["operation_id"],
            "detail": {},
            "tombstoned": False,
            "tombstone_reason": None,
            "version": 1,
        }
        return uuid.UUID(op["operation_id"])

    def request(self, member_id: uuid.UUID, kind: str, **params: Any) -> uuid.UUID:
        """Request `kind` (remove, drain, recover, replace) on a member; returns the operation id."""
        m = self.members_[member_id]
        if any(o["member_id"] == str(member_id) and o["status"] in OPEN for o in self.operations.values()):
            raise ValueError(f"an operation is still open on member {member_id}")
        if kind == "remove" and m["status"] == "stopped":
            params = {**params, "drained": True}
        op = self._operation(
            uuid.UUID(m["instance_id"]), kind, member_id, m["component_key"], uuid.UUID(m["allocation_id"]), params
        )
        self._reoffer(uuid.UUID(m["instance_id"]))
        return uuid.UUID(op["operation_id"])

    async def decommission(self, instance_id: uuid.UUID, *, settle: bool = True) -> None:
        """A `remove` of every live member; the instance is `decommissioned` once each teardown is verified."""
        self._set_status(instance_id, "decommissioning")
        for m in self.members(instance_id):
            self.request(uuid.UUID(m["member_id"]), "remove", decommission=True, verify_teardown=True)
        self._check_decommission(instance_id)
        if settle:
            await self.settle()

    async def settle(self, *, max_rounds: int = 100) -> list[uuid.UUID]:
        """Claim and handle operations one at a time until none can be claimed (a deferred one waits for its
        instance to change), then reconcile every live instance once. Returns the operations handled, in order."""
        handled: list[uuid.UUID] = []
        for _ in range(max_rounds):
            claim = await self.client.claim(self.app_slug, lease_s=self.loop.lease_s, holder="harness")
            if claim is None:
                break
            handled.append(claim.operation.operation_id)
            await self.loop.handle(claim)
        else:
            raise AssertionError(f"still claiming after {max_rounds} operations: {self.pending()}")
        for iid, inst in self.instances.items():
            if inst.data["status"] not in ("decommissioned", "decommissioning"):
                await self.reconcile(iid)
        return handled

    async def reconcile(self, instance_id: uuid.UUID) -> None:
        """Run the controller's reconcile of one instance now (as the loop's timer would)."""
        self.loop.watch_instance(await self.client.instance(instance_id))
        await self.loop.reconcile_instance(instance_id)

    # ------------------------------------------------------------------------------------ what a test reads

    def instance(self, instance_id: uuid.UUID) -> Any:
        from gpuaas.sdk.models import Instance

        return Instance.model_validate(self.instances[instance_id].data)

    def members(self, instance_id: uuid.UUID, *, include_tombstones: bool = False) -> list[dict[str, Any]]:
        return [
            m
            for m in self.members_.values()
            if m["instance_id"] == str(instance_id) and (include_tombstones or not m["tombstoned"])
        ]

    def operation(self, operation_id: uuid.UUID) -> dict[str, Any]:
        return self.operations[operation_id]

    def pending(self) -> list[dict[str, Any]]:
        return [o for o in self.operations.values() if o["status"] in OPEN]

    def state(self, instance_id: uuid.UUID) -> dict[str, Any]:
        return self.instances[instance_id].state

    # ------------------------------------------------------------------------------------ the model

    def _operation(
        self,
        instance_id: uuid.UUID,
        kind: str,
        member_id: uuid.UUID,
        role: str,
        allocation_id: uuid.UUID,
        params: dict[str, Any],
    ) -> dict[str, Any]:
        self._seq += 1
        op_id = uuid.UUID(int=(uuid.uuid4().int & ~(0xFFFFFFFF << 96)) | (self._seq << 96))  # ordered by seq
        at = _now()
        op: dict[str, Any] = {
            "operation_id": str(op_id),
            "instance_id": str(instance_id),
            "project_id": str(self.project_id),
            "app_slug": self.app_slug,
            "kind": kind,
            "status": "pending",
            "member_id": str(member_id),
            "result_member_id": None,
            "component_key": role,
            "allocation_id": str(allocation_id),
            "params": params,
            "claimed_by": None,
            "lease_expires_at": None,
            "attempt": 0,
            "progress_message": "",
            "progress_percent": None,
            "error": None,
            "forced": False,
            "result": {},
            "lease_s": None,
            "deferred_until": None,
            "version": 1,
            "created_at": at,
            "updated_at": at,
            "_seq": self._seq,
            "_token": None,
            "_deferred": False,
        }
        self.operations[op_id] = op
        return op

    @staticmethod
    def _public(op: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in op.items() if not k.startswith("_")}

    def _hold(self, op: dict[str, Any]) -> bool:
        """The platform's role ordering (`after`), as `app_runtime.domain.ordering_hold`."""
        order = {r["key"]: set(r.get("after") or []) for r in self.roles}
        role, iid = op["component_key"], uuid.UUID(op["instance_id"])
        coming_up = {m["component_key"] for m in self.members(iid) if m["status"] in ("pending", "starting")}
        if op["kind"] in BRINGS_UP and order.get(role, set()) & coming_up:
            return True
        if op["kind"] in TAKES_AWAY:
            dependents = {r for r, before in order.items() if role in before}
            return any(
                o is not op
                and o["instance_id"] == op["instance_id"]
                and o["status"] in OPEN
                and o["kind"] in TAKES_AWAY
                and o["component_key"] in dependents
                for o in self.operations.values()
            )
        return False

    def _reoffer(self, instance_id: uuid.UUID) -> None:
        for o in self.operations.values():
            if o["instance_id"] == str(instance_id):
                o["_deferred"] = False
                o["deferred_until"] = None

    def _set_status(self, instance_id: uuid.UUID, status: str) -> None:
        inst = self.instances[instance_id].data
        if inst["status"] != status:
            inst.update(status=status, status_changed_at=_now(), version=inst["version"] + 1)

    def _recompute(self, instance_id: uuid.UUID) -> None:
        inst = self.instances[instance_id].data
        if inst["status"] not in ("created", "starting", "running", "degraded", "failed"):
            return
        statuses = [m["status"] for m in self.members(instance_id)]
        staying = [s for s in statuses if s not in ("stopping", "draining", "stopped")] or statuses
        if "failed" in staying:
            self._set_status(instance_id, "degraded")
        elif staying and all(s == "active" for s in staying):
            self._set_status(instance_id, "running")
        elif any(s in ("pending", "starting") for s in staying):
            if inst["status"] in ("created", "starting"):
                self._set_status(instance_id, "starting")
        elif inst["status"] == "running":
            self._set_status(instance_id, "degraded")

    def _check_decommission(self, instance_id: uuid.UUID) -> None:
        inst = self.instances[instance_id].data
        if inst["status"] != "decommissioning":
            return
        removes = [
            o for o in self.operations.values() if o["instance_id"] == str(instance_id) and o["kind"] == "remove"
        ]
        if any(o["status"] in OPEN for o in removes):
            return
        verified = [o for o in removes if o["status"] == "succeeded" and o["result"].get("teardown_verified") is True]
        unverified = [o["member_id"] for o in removes if o not in verified]
        inst["decommission"] = {
            "forced": False,
            "verified_member_ids": [o["member_id"] for o in verified],
            "unverified_member_ids": unverified,
            "evidence": [str(o["result"].get("evidence") or o["error"] or o["status"]) for o in removes],
            "reason": "",
        }
        if unverified:
            self._set_status(instance_id, "decommission_failed")
        else:
            self._set_status(instance_id, "decommissioned")
            inst["runtime_detail"] = {}
            inst["health"] = {"status": "unknown", "message": "instance decommissioned"}

    def _after(self, op: dict[str, Any], outcome: str, result: dict[str, Any], detail: dict[str, Any] | None) -> None:
        op.update(status=outcome, _token=None, lease_expires_at=None, updated_at=_now())
        member = self.members_[uuid.UUID(op["member_id"])]
        if detail is not None:
            member["detail"] = detail
        if outcome == "failed":
            member["status"] = "failed"
        elif op["kind"] in BRINGS_UP:
            member["status"] = "active"
        elif op["kind"] == "drain":
            member["status"] = "stopped"
        elif op["kind"] == "remove":
            verified = result.get("teardown_verified") is True
            member.update(
                status="removed",
                tombstoned=True,
                tombstone_reason=f"removed by {op['operation_id']}" + ("" if verified else " (teardown not verified)"),
            )
        iid = uuid.UUID(op["instance_id"])
        self._reoffer(iid)
        self._recompute(iid)
        self._check_decommission(iid)

    def _held(self, op_id: str, body: dict[str, Any]) -> dict[str, Any] | None:
        op = self.operations.get(uuid.UUID(op_id))
        if op is None or op["_token"] != body.get("lease_token") or op["status"] not in ("claimed", "in_progress"):
            return None
        return op

    async def _route(self, request: httpx.Request) -> httpx.Response:  # one branch per route of the API
        path = request.url.path.removeprefix(self.client.ar)
        body: dict[str, Any] = json.loads(request.content) if request.content else {}
        parts = path.strip("/").split("/")
        method = request.method

        def ok(data: Any, status: int = 200) -> httpx.Response:
            return httpx.Response(status, json=data)

        def problem(status: int, code: str, detail: str = "") -> httpx.Response:
            return httpx.Response(status, json={"code": code, "detail": detail, "status": status})

        if path.startswith("/api/allocations/allocations/"):
            aid = parts[-1]
            return ok({"network": {"address": f"10.0.{int(aid[:2], 16)}.{int(aid[2:4], 16)}"}, "ssh_endpoint": None})
        if parts[0] == "instances" and method == "GET":
            return ok(self.instances[uuid.UUID(parts[1])].data)
        if parts[:2] == ["controller", "instances"] and len(parts) == 2:
            live = [i.data for i in self.instances.values() if i.data["status"] != "decommissioned"]
            return ok({"items": live})
        if parts[:2] == ["controller", "instances"]:
            iid = uuid.UUID(parts[2])
            inst = self.instances[iid]
            what = parts[3]
            if what == "members":
                return ok({"items": self.members(iid)})
            if what == "state" and method == "GET":
                return ok({"state": inst.state, "version": inst.state_version})
            if what == "state":
                if body["expected_version"] != inst.state_version:
                    return problem(409, "state_version_conflict")
                inst.state, inst.state_version = body["state"], inst.state_version + 1
                return ok({"state": inst.state, "version": inst.state_version})
            if what == "events":
                self._seq += 1
                entry: dict[str, Any] = {
                    "seq": self._seq,
                    "instance_id": str(iid),
                    "kind": f"controller.{body['kind']}",
                    "message": body.get("message", ""),
                    "data": body.get("data") or {},
                    "actor": "controller",
                    "occurred_at": _now(),
                }
                self.events.append(entry)
                return ok(entry, 201)
            if what == "status":
                for key in ("runtime_detail", "app_version"):
                    if body.get(key) is not None:
                        inst.data[key] = body[key]
                if body.get("health") is not None:
                    inst.data["health"] = {**body["health"], "checked_at": _now()}
                if body.get("status"):
                    self._set_status(iid, body["status"])
                return ok(inst.data)
            if what == "credential":
                return ok(self._credential(iid))
            if what == "operations":  # the controller requests one
                if body["kind"] == "add":
                    op_id = self.add(iid, body.get("component_key") or self.roles[-1]["key"], None)
                else:
                    op_id = self.request(uuid.UUID(body["member_id"]), body["kind"], **(body.get("params") or {}))
                return ok(self._public(self.operations[op_id]), 201)
        if parts[:2] == ["controller", "members"]:
            member = self.members_[uuid.UUID(parts[2])]
            if body.get("detail") is not None:
                member["detail"] = body["detail"]
            if body.get("status"):
                member["status"] = body["status"]
                self._recompute(uuid.UUID(member["instance_id"]))
            self._reoffer(uuid.UUID(member["instance_id"]))
            return ok(member)
        if parts[:3] == ["controller", "operations", "claim"]:
            for op in sorted(self.operations.values(), key=lambda o: o["_seq"]):
                if op["status"] == "pending" and not op["_deferred"] and not self._hold(op):
                    token = str(uuid.uuid4())
                    op.update(status="claimed", _token=token, attempt=op["attempt"] + 1, lease_s=body.get("lease_s"))
                    op["lease_expires_at"] = _now()
                    target = self.members_[uuid.UUID(op["member_id"])]
                    target["status"] = {
                        "add": "starting",
                        "replace": "starting",
                        "recover": "starting",
                        "drain": "draining",
                        "remove": "stopping",
                    }[op["kind"]]
                    self._recompute(uuid.UUID(op["instance_id"]))
                    return ok({"operation": self._public(op), "lease_token": token, "lease_expires_at": _now()})
            return httpx.Response(204)
        if parts[:2] == ["controller", "operations"]:
            op = self._held(parts[2], body)
            if op is None:
                return problem(409, "lease_lost", "this lease is no longer held")
            action = parts[3]
            if action == "heartbeat":
                op.update(status="in_progress", lease_s=body.get("lease_s") or op["lease_s"])
                if body.get("message") is not None:
                    op["progress_message"] = body["message"]
                if body.get("percent") is not None:
                    op["progress_percent"] = body["percent"]
            elif action == "complete":
                result: dict[str, Any] = body.get("result") or {}
                op["result"] = result
                self._after(op, "succeeded", result, body.get("member_detail"))
            elif action == "fail":
                op["error"] = body["error"]
                self._after(op, "failed", {}, None)
            elif action == "defer":
                op.update(status="pending", _token=None, attempt=op["attempt"] - 1, _deferred=True)
                op["deferred_until"] = _now()
            return ok(self._public(op))
        return problem(404, "not_found", f"the in-memory harness has no {method} {path}")

    def _credential(self, instance_id: uuid.UUID) -> dict[str, Any]:
        import asyncssh

        key = asyncssh.generate_private_key("ssh-ed25519")  # pyright: ignore[reportUnknownMemberType]
        return {
            "credential_id": str(uuid.uuid4()),
            "instance_id": str(instance_id),
            "public_key": key.export_public_key("openssh").decode().strip(),
            "fingerprint": key.get_fingerprint(),
            "custody": "memory",
            "status": "active",
            "allocation_ids": sorted({m["allocation_id"] for m in self.members(instance_id)}),
            "rotated_from": None,
            "created_at": _now(),
            "private_key": key.export_private_key("openssh").decode(),
        }
