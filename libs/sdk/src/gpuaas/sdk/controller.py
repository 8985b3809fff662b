"""The controller reconcile loop: claim → act → report, crash-safe through leases.

    class SlurmAdapter(Controller):
        async def add(self, ctx):      # bring up ctx.operation.component_key on ctx.operation.allocation_id
            key = await ctx.credential()          # SSH key installed on the member allocations
            ...                                   # idempotent work; await ctx.progress("...") now and then
            return {"node": "gpu-01"}             # → operation succeeded, member active

        async def remove(self, ctx):
            ...
            return {"teardown_verified": True, "evidence": "slurmd stopped, /var/lib/slurm wiped"}

    loop = ReconcileLoop(client, app_slug="slurm", controller=SlurmAdapter())
    await loop.run()                              # until loop.stop()

Guarantees and rules:
- Every claim holds a lease; a background heartbeat extends it while the handler runs. If the process
  dies, the lease runs out and the platform makes the operation claimable again: another replica (or the
  restarted one) does it again. Handlers must therefore be idempotent (check before doing).
- If a heartbeat answers `lease_lost` (the lease expired, an operator cancelled, retried or force-failed),
  the handler is cancelled and nothing is reported: the platform has already moved on.
- Returning a dict completes the operation with that result; raising `OperationFailed` fails it with the
  message (the member becomes `failed` and can be recovered); any other exception fails it too, with
  the exception text, so one bad operation never stops the loop.
- Between claims, `reconcile(instance)` is called for each desired instance (e.g. roll out
  `desired_app_version`, report health).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from gpuaas.sdk.client import ApiError, Client
from gpuaas.sdk.models import Claim, CredentialSecret, Instance, Operation

log = logging.getLogger("gpuaas.sdk.controller")


class OperationFailed(Exception):
    """Raise from a handler to fail the operation with this message."""


class LeaseLost(Exception):
    """The platform no longer considers this replica the holder of the operation."""


@dataclass
class OperationContext:
    client: Client
    claim: Claim
    app_slug: str
    _credential: CredentialSecret | None = field(default=None, repr=False)

    @property
    def operation(self) -> Operation:
        return self.claim.operation

    @property
    def lease_token(self) -> uuid.UUID:
        return self.claim.lease_token

    async def progress(self, message: str, percent: int | None = None) -> None:
        """Report progress (also extends the lease). Raises LeaseLost when the lease is gone."""
        try:
            await self.client.heartbeat(self.operation.operation_id, self.lease_token, message=message, percent=percent)
        except ApiError as exc:
            if exc.code == "lease_lost":
                raise LeaseLost(str(exc)) from exc
            raise

    async def instance(self) -> Instance:
        return await self.client.instance(self.operation.instance_id)

    async def credential(self) -> CredentialSecret:
        """The instance's SSH key pair (fetched once per operation, kept in memory only)."""
        if self._credential is None:
            self._credential = await self.client.fetch_credential(self.operation.instance_id)
        return self._credential

    async def event(self, kind: str, message: str = "", **data: Any) -> None:
        await self.client.report_event(self.operation.instance_id, kind, message, **data)


class Controller:
    """Subclass and implement the operation kinds your app supports; the rest fail with a clear error."""

    async def add(self, ctx: OperationContext) -> dict[str, Any]:
        raise OperationFailed("this controller does not implement add")

    async def drain(self, ctx: OperationContext) -> dict[str, Any]:
        raise OperationFailed("this controller does not implement drain")

    async def remove(self, ctx: OperationContext) -> dict[str, Any]:
        raise OperationFailed("this controller does not implement remove")

    async def replace(self, ctx: OperationContext) -> dict[str, Any]:
        raise OperationFailed("this controller does not implement replace")

    async def recover(self, ctx: OperationContext) -> dict[str, Any]:
        raise OperationFailed("this controller does not implement recover")

    async def reconcile(self, client: Client, instance: Instance) -> None:
        """Called for each desired instance between claims; default: nothing."""


class ReconcileLoop:
    def __init__(
        self,
        client: Client,
        *,
        app_slug: str,
        controller: Controller,
        lease_s: int = 30,
        heartbeat_every_s: float | None = None,
        poll_interval_s: float = 1.0,
        holder: str | None = None,
    ) -> None:
        self.client = client
        self.app_slug = app_slug
        self.controller = controller
        self.lease_s = lease_s
        self.heartbeat_every_s = heartbeat_every_s or max(lease_s / 3, 1.0)
        self.poll_interval_s = poll_interval_s
        self.holder = holder or f"replica-{uuid.uuid4().hex[:8]}"
        self._stop = asyncio.Event()
        self.handled: list[Operation] = []  # outcomes this replica reported, newest last

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        """Claim and handle operations until `stop()` (a stopped loop may be run again)."""
        self._stop.clear()
        while not self._stop.is_set():
            try:
                did = await self.run_once()
                if not did:
                    await self._reconcile_instances()
            except ApiError as exc:  # platform said no (e.g. binding removed): log and keep going
                log.warning("controller_api_error %s", exc)
                did = False
            except OSError as exc:  # network: retry after a pause
                log.warning("controller_network_error %s", exc)
                did = False
            if not did:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.poll_interval_s)

    async def run_once(self) -> bool:
        """Claim and handle one operation; False when there was nothing to claim."""
        claim = await self.client.claim(self.app_slug, lease_s=self.lease_s, holder=self.holder)
        if claim is None:
            return False
        await self.handle(claim)
        return True

    async def handle(self, claim: Claim) -> Operation | None:
        ctx = OperationContext(self.client, claim, self.app_slug)
        op = claim.operation
        handler = getattr(self.controller, str(op.kind))
        work = asyncio.create_task(handler(ctx), name=f"op-{op.operation_id}")
        beat = asyncio.create_task(self._heartbeat(ctx, work), name=f"lease-{op.operation_id}")
        try:
            result = await work
        except LeaseLost:
            log.warning("lease_lost operation=%s", op.operation_id)
            return None
        except asyncio.CancelledError:
            if self._stop.is_set() or beat.done():
                return None  # cancelled because the lease was lost
            raise
        except OperationFailed as exc:
            return await self._report(self.client.fail(op.operation_id, claim.lease_token, str(exc) or "failed"))
        except Exception as exc:  # a bug in the adapter must not stop the loop
            log.exception("handler_error operation=%s", op.operation_id)
            return await self._report(
                self.client.fail(op.operation_id, claim.lease_token, f"{exc.__class__.__name__}: {exc}")
            )
        finally:
            if not work.done():  # we are being cancelled (shutdown, or a test "killing" the replica)
                work.cancel()
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await beat
        return await self._report(self.client.complete(op.operation_id, claim.lease_token, result=result or {}))

    async def _report(self, call: Any) -> Operation | None:
        try:
            done: Operation = await call
        except ApiError as exc:
            if exc.code == "lease_lost":  # someone else owns it now: their report counts
                log.warning("report_after_lease_lost %s", exc)
                return None
            raise
        self.handled.append(done)
        return done

    async def _heartbeat(self, ctx: OperationContext, work: asyncio.Task[Any]) -> None:
        while not work.done():
            await asyncio.sleep(self.heartbeat_every_s)
            if work.done():
                return
            try:
                await self.client.heartbeat(ctx.operation.operation_id, ctx.lease_token, lease_s=self.lease_s)
            except ApiError as exc:
                if exc.code == "lease_lost":
                    work.cancel()
                    return
                log.warning("heartbeat_failed %s", exc)
            except OSError as exc:
                log.warning("heartbeat_network_error %s", exc)

    async def _reconcile_instances(self) -> None:
        for instance in await self.client.desired_instances(self.app_slug):
            await self.controller.reconcile(self.client, instance)
