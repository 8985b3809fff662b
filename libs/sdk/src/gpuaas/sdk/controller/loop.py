"""The controller loop: claim → act → report for member operations (crash-safe through leases), and a
rate-limited work queue of instances to reconcile (on a timer per instance, and when one changes).

Operations:
- Every claim holds a lease; a background heartbeat extends it while the handler runs. If the process dies the
  lease runs out and the platform makes the operation claimable again, so handlers must be idempotent.
- A heartbeat answering `lease_lost` cancels the handler; nothing is reported (the platform has moved on).
- Returning a dict completes the operation with that result and `ctx.member_detail` as the member's detail;
  `PermanentError` fails it; `TemporaryError(delay=)` runs the handler again after the delay (else the
  back-off) while the lease is kept, at most `max_temporary_retries` times; any other exception fails it
  with the exception text, so one bad operation never stops the loop.

Reconcile (instead of every idle poll): the desired instances are listed every `watch_every_s`; a new
instance or a new `version` of one queues it at once, a finished operation queues its instance, and each
instance is queued again `reconcile_every_s` after its last reconcile. A failing reconcile is requeued
with per-instance exponential back-off. An operation and a reconcile of the same instance never overlap.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, cast

import httpx

from gpuaas.sdk.client import ApiError, Client
from gpuaas.sdk.controller.context import OperationContext, ReconcileContext
from gpuaas.sdk.controller.errors import LeaseLost, PermanentError, TemporaryError
from gpuaas.sdk.controller.handlers import Controller
from gpuaas.sdk.controller.metrics import ControllerMetrics
from gpuaas.sdk.controller.queue import Backoff, WorkQueue
from gpuaas.sdk.models import Claim, Instance, Operation

log = logging.getLogger("gpuaas.sdk.controller")
LIVE = frozenset({"created", "starting", "running", "degraded", "stopping", "stopped", "failed"})


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
        watch_every_s: float = 2.0,
        reconcile_every_s: float | None = None,
        max_temporary_retries: int = 5,
        backoff: Backoff | None = None,
        qps: float = 10.0,
        metrics: ControllerMetrics | None = None,
    ) -> None:
        self.client = client
        self.app_slug = app_slug
        self.controller = controller
        self.lease_s = lease_s
        self.heartbeat_every_s = heartbeat_every_s or max(lease_s / 3, 1.0)
        self.poll_interval_s = poll_interval_s
        self.holder = holder or f"replica-{uuid.uuid4().hex[:8]}"
        self.watch_every_s = watch_every_s
        self.reconcile_every_s = reconcile_every_s or controller.reconcile_every_s
        self.max_temporary_retries = max_temporary_retries
        self.backoff = backoff or Backoff()
        self.queue: WorkQueue[uuid.UUID] = WorkQueue(backoff=self.backoff, qps=qps)
        self.metrics = metrics or ControllerMetrics()
        self._stop = asyncio.Event()
        self._seen: dict[uuid.UUID, int] = {}  # instance → the version last queued for
        self._instances: dict[uuid.UUID, Instance] = {}
        self._locks: dict[uuid.UUID, asyncio.Lock] = {}
        self._reasons: dict[uuid.UUID, str] = {}
        self.handled: list[Operation] = []  # outcomes this replica reported, newest last
        self.last_contact = 0.0  # monotonic time the platform last answered (for /healthz)
        self.running = False

    def stop(self) -> None:
        self._stop.set()

    def _lock(self, instance_id: uuid.UUID) -> asyncio.Lock:
        return self._locks.setdefault(instance_id, asyncio.Lock())

    def _contact(self) -> None:
        self.last_contact = time.monotonic()
        self.metrics.last_contact.set_to_current_time()

    async def run(self) -> None:
        """Claim, handle and reconcile until `stop()` (a stopped loop may be run again). On stop, the
        operation in hand finishes (or its lease runs out) before this returns."""
        self._stop.clear()
        self.running = True
        tasks = [
            asyncio.create_task(self._claims(), name="claims"),
            asyncio.create_task(self._watch(), name="watch"),
            asyncio.create_task(self._reconciles(), name="reconciles"),
        ]
        claims, *others = tasks
        stopped = asyncio.create_task(self._stop.wait(), name="stopped")
        try:
            done, _ = await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for t in done - {stopped}:
                t.result()  # a task ended by itself only on a bug: raise it here rather than hang half-alive
        except BaseException:
            claims.cancel()  # cancelled, not stopped (a test "killing" the replica): drop the work in hand
            raise
        finally:
            stopped.cancel()
            self.running = False
            for t in others:
                t.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            with contextlib.suppress(asyncio.CancelledError):
                await claims  # stopped: returns once the operation in hand is reported

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    async def _claims(self) -> None:
        while not self._stop.is_set():
            try:
                did = await self.run_once()
            except ApiError as exc:  # platform said no (e.g. binding removed): log and keep going
                self.metrics.claim_polls.labels("error").inc()
                log.warning("controller_api_error %s", exc)
                did = False
            except (OSError, httpx.TransportError) as exc:  # network: retry after a pause
                self.metrics.claim_polls.labels("error").inc()
                log.warning("controller_network_error %s", exc)
                did = False
            if not did:
                await self._pause(self.poll_interval_s)

    async def run_once(self) -> bool:
        """Claim and handle one operation; False when there was nothing to claim."""
        claim = await self.client.claim(self.app_slug, lease_s=self.lease_s, holder=self.holder)
        self._contact()
        if claim is None:
            self.metrics.claim_polls.labels("idle").inc()
            log.debug("claim_idle app=%s", self.app_slug)
            return False
        self.metrics.claim_polls.labels("claimed").inc()
        await self.handle(claim)
        return True

    # ------------------------------------------------------------------------------------------ operations

    async def handle(self, claim: Claim) -> Operation | None:
        op = claim.operation
        started = time.monotonic()
        log.info(
            "operation_claimed operation=%s kind=%s role=%s attempt=%s",
            op.operation_id,
            op.kind,
            op.component_key,
            op.attempt,
        )
        async with self._lock(op.instance_id):
            done = await self._handle(claim)
        self.metrics.operation_seconds.labels(str(op.kind)).observe(time.monotonic() - started)
        self._reasons[op.instance_id] = "operation"
        self.queue.add(op.instance_id)  # what the operation changed is reconciled next
        return done

    async def _handle(self, claim: Claim) -> Operation | None:
        op = claim.operation
        ctx = OperationContext(self.client, claim, self.app_slug, controller=self.controller)
        work = asyncio.create_task(self._attempts(ctx), name=f"op-{op.operation_id}")
        beat = asyncio.create_task(self._heartbeat(ctx, work), name=f"lease-{op.operation_id}")
        kind = str(op.kind)
        try:
            result = await work
        except LeaseLost:
            log.warning("lease_lost operation=%s", op.operation_id)
            self.metrics.operations.labels(kind, "lease_lost").inc()
            return None
        except asyncio.CancelledError:
            if beat.done():
                self.metrics.operations.labels(kind, "lease_lost").inc()
                return None  # cancelled because the lease was lost
            raise
        except (PermanentError, TemporaryError) as exc:
            log.info("operation_failed operation=%s error=%s", op.operation_id, exc)
            self.metrics.operations.labels(kind, "failed").inc()
            return await self._report(self.client.fail(op.operation_id, claim.lease_token, str(exc) or "failed"))
        except Exception as exc:  # a bug in the adapter must not stop the loop
            log.exception("handler_error operation=%s", op.operation_id)
            self.metrics.operations.labels(kind, "error").inc()
            return await self._report(
                self.client.fail(op.operation_id, claim.lease_token, f"{exc.__class__.__name__}: {exc}")
            )
        finally:
            if not work.done():  # we are being cancelled (a test "killing" the replica)
                work.cancel()
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await beat
        self.metrics.operations.labels(kind, "succeeded").inc()
        log.info("operation_succeeded operation=%s kind=%s", op.operation_id, kind)
        return await self._report(
            self.client.complete(
                op.operation_id, claim.lease_token, result=result or {}, member_detail=ctx.member_detail or None
            )
        )

    async def _attempts(self, ctx: OperationContext) -> dict[str, Any] | None:
        op = ctx.operation
        handler = self.controller.handler_for(str(op.kind), op.component_key)
        if handler is None:
            raise PermanentError(f"this controller has no {op.kind} handler for role {op.component_key!r}")
        while True:
            try:
                return await handler(ctx)
            except NotImplementedError as exc:
                raise PermanentError(f"this controller does not implement {op.kind}") from exc
            except TemporaryError as exc:
                if ctx.attempt >= self.max_temporary_retries:
                    raise TemporaryError(f"gave up after {ctx.attempt + 1} tries: {exc}") from exc
                delay = exc.delay if exc.delay is not None else self.backoff.delay(ctx.attempt)
                ctx.attempt += 1
                self.metrics.temporary_retries.inc()
                log.info("operation_retry operation=%s in_s=%.1f error=%s", op.operation_id, delay, exc)
                await ctx.progress(f"retrying in {delay:.0f}s: {exc}")
                await asyncio.sleep(delay)

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
            except (OSError, httpx.TransportError) as exc:
                log.warning("heartbeat_network_error %s", exc)

    # ------------------------------------------------------------------------------------------- reconcile

    async def _watch(self) -> None:
        """List the desired instances: queue the new and the changed ones, forget the gone ones."""
        while not self._stop.is_set():
            try:
                listed = await self.client.desired_instances(self.app_slug)
                self._contact()
                now = {i.instance_id: i for i in listed}
                for iid, inst in now.items():
                    if self._seen.get(iid) != inst.version:
                        self._reasons.setdefault(iid, "changed")
                        self._seen[iid] = inst.version
                        self.queue.add(iid)
                    self._instances[iid] = inst
                for gone in set(self._seen) - set(now):
                    self._seen.pop(gone, None)
                    self._instances.pop(gone, None)
                self.metrics.queue_depth.set(len(self.queue))
            except (ApiError, OSError, httpx.TransportError) as exc:
                log.warning("watch_error %s", exc)
            await self._pause(self.watch_every_s)

    async def _reconciles(self) -> None:
        while True:
            iid = await self.queue.get()
            try:
                await self.reconcile_instance(iid)
            finally:
                self.queue.done(iid)

    async def reconcile_instance(self, instance_id: uuid.UUID) -> None:
        inst = self._instances.get(instance_id)
        reason = self._reasons.pop(instance_id, "timer")
        if inst is None:
            return  # no longer desired: its timer stops here
        try:
            async with self._lock(instance_id):
                inst = await self.client.instance(instance_id) if reason == "operation" else inst
                if self.controller.legacy_reconcile():
                    # `reconcile(self, client, instance)`, the signature legacy_reconcile() just found
                    legacy = cast(Callable[[Client, Instance], Awaitable[None]], self.controller.reconcile)
                    await legacy(self.client, inst)
                else:
                    await self.controller.reconcile(ReconcileContext(self.client, self.controller, inst, reason))
        except TemporaryError as exc:
            delay = exc.delay if exc.delay is not None else self.queue.add_rate_limited(instance_id)
            if exc.delay is not None:
                self.queue.add_after(instance_id, delay)
            self.metrics.reconciles.labels("retry").inc()
            log.info("reconcile_retry instance=%s in_s=%.1f error=%s", instance_id, delay, exc)
            return
        except Exception as exc:  # logged, backed off: a reconcile never stops the loop
            delay = self.queue.add_rate_limited(instance_id)
            self.metrics.reconciles.labels("error").inc()
            log.warning("reconcile_error instance=%s in_s=%.1f error=%r", instance_id, delay, exc)
            return
        self.queue.forget(instance_id)
        self.metrics.reconciles.labels("ok").inc()
        log.debug("reconciled instance=%s reason=%s", instance_id, reason)
        self.queue.add_after(instance_id, self.reconcile_every_s)
