"""The controller loop: claim → act → report for member operations (crash-safe through leases), and a
rate-limited work queue of instances to reconcile (on a timer per instance, and when one changes).

Operations:
- Up to `max_concurrent_operations` at once (several instances, several members of one instance), never two
  on the same member; the platform hands them out in the app's role order (a role's `after` in the manifest).
- Every claim holds a lease; a background heartbeat extends it while the handler runs. If the process dies the
  lease runs out and the platform makes the operation claimable again, so handlers must be idempotent.
- A heartbeat answering `lease_lost` cancels the handler; nothing is reported (the platform has moved on).
- Returning a dict completes the operation with that result and `ctx.member_detail` as the member's detail;
  `PermanentError` fails it; `TemporaryError(delay=)` runs the handler again after the delay (else the
  back-off) while the lease is kept, at most `max_temporary_retries` times; `Defer` (`ctx.defer()`) gives it
  back without counting as an attempt, to be offered again when the instance changes; any other exception
  fails it with the exception text, so one bad operation never stops the loop.
- A `remove` runs the role's `drain` handler first, if any, within a deadline (handlers.py); a `drain` runs within
  its own (`params.deadline_at`, a time, e.g. a preemption's; else `drain_deadline_s` or `deadline_s`).

Reconcile (instead of every idle poll): the desired instances are listed every `watch_every_s`; a new
instance or a new `version` of one queues it at once, a finished operation queues its instance, and each
instance is queued again `reconcile_every_s` after its last reconcile. A failing reconcile is requeued
with per-instance exponential back-off. An operation and a reconcile of the same instance never overlap.
Each instance's reconcile outcome is logged at INFO at most once per `reconcile_log_every_s` (and whenever it
changes); the others at DEBUG.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, cast

import httpx

from gpuaas.sdk.client import ApiError, Client
from gpuaas.sdk.controller.context import OperationContext, ReconcileContext, ShellFactory
from gpuaas.sdk.controller.errors import Defer, LeaseLost, PermanentError, TemporaryError
from gpuaas.sdk.controller.handlers import Controller
from gpuaas.sdk.controller.metrics import ControllerMetrics
from gpuaas.sdk.controller.queue import Backoff, WorkQueue
from gpuaas.sdk.models import Claim, Instance, Operation

log = logging.getLogger("gpuaas.sdk.controller")


def drain_deadline_s(params: dict[str, Any]) -> float | None:
    """How long a drain may run: until `deadline_at` (a time: a preemption's drain must end before the
    allocation is stopped, however long the operation waited to be claimed), else `drain_deadline_s` or
    `deadline_s` seconds; None when the operation names none."""
    if at := params.get("deadline_at"):
        return max((datetime.fromisoformat(str(at)) - datetime.now(UTC)).total_seconds(), 0.0)
    return float(params.get("drain_deadline_s") or params.get("deadline_s") or 0) or None


LIVE = frozenset({"created", "starting", "running", "degraded", "stopping", "stopped", "failed"})


class _InstanceGate:
    """Operations of one instance run together; its reconcile runs alone (no operation of it in flight)."""

    def __init__(self) -> None:
        self.operations = 0
        self.reconciling = False
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def operation(self) -> AsyncGenerator[None, None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self.reconciling)
            self.operations += 1
        try:
            yield
        finally:
            async with self._changed:
                self.operations -= 1
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def reconcile(self) -> AsyncGenerator[None, None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self.reconciling and self.operations == 0)
            self.reconciling = True
        try:
            yield
        finally:
            async with self._changed:
                self.reconciling = False
                self._changed.notify_all()


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
        max_concurrent_operations: int = 4,
        reconcile_log_every_s: float = 60.0,
        shells: ShellFactory | None = None,
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
        self.max_concurrent_operations = max(1, max_concurrent_operations)
        self.reconcile_log_every_s = reconcile_log_every_s
        self.shells = shells  # contexts' shells when not SSH (InMemoryHarness)
        self._gates: dict[uuid.UUID, _InstanceGate] = {}
        self._member_locks: dict[uuid.UUID, asyncio.Lock] = {}
        self._in_flight: set[asyncio.Task[Operation | None]] = set()
        self._logged: dict[uuid.UUID, tuple[float, str]] = {}  # instance → (when, outcome) last logged at INFO
        self._reasons: dict[uuid.UUID, str] = {}
        self.handled: list[Operation] = []  # outcomes this replica reported, newest last
        self.last_contact = 0.0  # monotonic time the platform last answered (for /healthz)
        self.running = False

    def stop(self) -> None:
        self._stop.set()

    def _gate(self, instance_id: uuid.UUID) -> _InstanceGate:
        return self._gates.setdefault(instance_id, _InstanceGate())

    def _member_lock(self, member_id: uuid.UUID) -> asyncio.Lock:
        return self._member_locks.setdefault(member_id, asyncio.Lock())

    def _contact(self) -> None:
        self.last_contact = time.monotonic()
        self.metrics.last_contact.set_to_current_time()

    async def run(self) -> None:
        """Claim, handle and reconcile until `stop()` (a stopped loop may be run again). On stop, the
        operations in hand finish (or their leases run out) before this returns."""
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
                await claims  # stopped: returns once the operations in hand are reported

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stop.wait()

    async def _claims(self) -> None:
        """Claim while a slot is free (`max_concurrent_operations`), each claim handled in a task of its own;
        once stopped, wait for those in flight. Cancelled (a killed replica): cancel them."""
        slots = asyncio.Semaphore(self.max_concurrent_operations)
        try:
            while not self._stop.is_set():
                await slots.acquire()
                claim = None
                try:
                    if not self._stop.is_set():
                        claim = await self._claim()
                finally:
                    if claim is None:
                        slots.release()
                if claim is None:
                    await self._pause(self.poll_interval_s)
                    continue
                task = asyncio.create_task(self.handle(claim), name=f"op-{claim.operation.operation_id}")
                self._in_flight.add(task)
                self.metrics.operations_in_flight.set(len(self._in_flight))

                def finished(t: asyncio.Task[Operation | None]) -> None:
                    self._in_flight.discard(t)
                    self.metrics.operations_in_flight.set(len(self._in_flight))
                    slots.release()
                    if not t.cancelled() and t.exception() is not None:
                        log.error("operation_task_error %r", t.exception())

                task.add_done_callback(finished)
            if self._in_flight:
                await asyncio.gather(*self._in_flight, return_exceptions=True)
        except asyncio.CancelledError:
            for task in self._in_flight:
                task.cancel()
            raise

    async def _claim(self) -> Claim | None:
        try:
            claim = await self.client.claim(self.app_slug, lease_s=self.lease_s, holder=self.holder)
        except ApiError as exc:  # platform said no (e.g. binding removed): log and keep going
            self.metrics.claim_polls.labels("error").inc()
            log.warning("controller_api_error %s", exc)
            return None
        except (OSError, httpx.TransportError) as exc:  # network: retry after a pause
            self.metrics.claim_polls.labels("error").inc()
            log.warning("controller_network_error %s", exc)
            return None
        self._contact()
        if claim is None:
            self.metrics.claim_polls.labels("idle").inc()
            log.debug("claim_idle app=%s", self.app_slug)
            return None
        self.metrics.claim_polls.labels("claimed").inc()
        return claim

    async def run_once(self) -> bool:
        """Claim and handle one operation (to completion); False when there was nothing to claim."""
        claim = await self._claim()
        if claim is None:
            return False
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
        member = op.target_member_id or op.operation_id
        async with self._gate(op.instance_id).operation(), self._member_lock(member):
            done = await self._handle(claim)
        self.metrics.operation_seconds.labels(str(op.kind)).observe(time.monotonic() - started)
        self._reasons[op.instance_id] = "operation"
        self.queue.add(op.instance_id)  # what the operation changed is reconciled next
        return done

    async def _handle(self, claim: Claim) -> Operation | None:
        op = claim.operation
        ctx = OperationContext(
            self.client, claim, self.app_slug, controller=self.controller, lease_s=self.lease_s, shells=self.shells
        )
        work = asyncio.create_task(self._attempts(ctx), name=f"op-{op.operation_id}")
        beat = asyncio.create_task(self._heartbeat(ctx, work), name=f"lease-{op.operation_id}")
        kind = str(op.kind)
        try:
            result = await work
        except Defer as exc:
            log.info("operation_deferred operation=%s reason=%s", op.operation_id, exc)
            self.metrics.operations.labels(kind, "deferred").inc()
            await self._report(
                self.client.defer(op.operation_id, claim.lease_token, reason=str(exc), delay_s=exc.delay),
                keep=False,
            )
            return None
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
        kind = str(op.kind)
        handler = self.controller.handler_for(kind, op.component_key)
        if handler is None:
            raise PermanentError(f"this controller has no {op.kind} handler for role {op.component_key!r}")
        deadline = drain_deadline_s(op.params)
        if kind == "drain" and deadline is not None:
            try:
                async with asyncio.timeout(deadline):
                    return await self._retrying(ctx, handler)
            except TimeoutError:
                raise PermanentError(f"the drain did not finish within its deadline of {deadline:.0f}s") from None
        drain = self.controller.handler_for("drain", op.component_key) if kind == "remove" else None
        if drain is None or op.params.get("drained"):
            return await self._retrying(ctx, handler)
        drained = await self._drain_first(ctx, drain, deadline or self.controller.drain_deadline_s)
        result = await self._retrying(ctx, handler)
        return {**(result or {}), "drain": drained}

    async def _drain_first(self, ctx: OperationContext, drain: Any, deadline_s: float) -> str:
        """A remove drains first: 'drained', or why not (the member is removed anyway)."""
        await ctx.progress(f"draining first (at most {deadline_s:g}s)")
        try:
            async with asyncio.timeout(deadline_s):
                await self._retrying(ctx, drain)
            return "drained"
        except TimeoutError:
            outcome = f"not drained within {deadline_s:g}s"
        except (PermanentError, TemporaryError) as exc:
            outcome = f"drain failed: {exc}"
        await ctx.progress(f"{outcome}; removing anyway")
        ctx.attempt = 0  # the remove gets its own retries
        return outcome

    async def _retrying(self, ctx: OperationContext, handler: Any) -> dict[str, Any] | None:
        op = ctx.operation
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
                ctx.forget()  # the next try reads the instance and the state again

    async def _report(self, call: Any, *, keep: bool = True) -> Operation | None:
        try:
            done: Operation = await call
        except ApiError as exc:
            if exc.code == "lease_lost":  # someone else owns it now: their report counts
                log.warning("report_after_lease_lost %s", exc)
                return None
            raise
        if keep:
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
                    self._logged.pop(gone, None)
                    if (gate := self._gates.get(gone)) is not None and not gate.operations and not gate.reconciling:
                        del self._gates[gone]
                self.metrics.queue_depth.set(len(self.queue))
            except (ApiError, OSError, httpx.TransportError) as exc:
                log.warning("watch_error %s", exc)
            await self._pause(self.watch_every_s)

    async def _reconciles(self) -> None:
        while not self._stop.is_set():
            iid = await self.queue.get()
            try:
                await self.reconcile_instance(iid)
            finally:
                self.queue.done(iid)

    def watch_instance(self, instance: Instance) -> None:
        """Know `instance` as if the watch had listed it (an in-memory harness reconciles it directly)."""
        self._instances[instance.instance_id] = instance
        self._seen[instance.instance_id] = instance.version

    async def reconcile_instance(self, instance_id: uuid.UUID) -> None:
        inst = self._instances.get(instance_id)
        reason = self._reasons.pop(instance_id, "timer")
        if inst is None:
            return  # no longer desired: its timer stops here
        try:
            async with self._gate(instance_id).reconcile():
                inst = await self.client.instance(instance_id) if reason == "operation" else inst
                if self.controller.legacy_reconcile():
                    # `reconcile(self, client, instance)`, the signature legacy_reconcile() just found
                    legacy = cast(Callable[[Client, Instance], Awaitable[None]], self.controller.reconcile)
                    await legacy(self.client, inst)
                else:
                    ctx = ReconcileContext(self.client, self.controller, inst, reason, shells=self.shells)
                    await self.controller.reconcile(ctx)
        except TemporaryError as exc:
            delay = exc.delay if exc.delay is not None else self.queue.add_rate_limited(instance_id)
            if exc.delay is not None:
                self.queue.add_after(instance_id, delay)
            self.metrics.reconciles.labels("retry").inc()
            self._log_reconcile(
                instance_id, "retry", logging.INFO, "reconcile_retry instance=%s in_s=%.1f error=%s", delay, exc
            )
            return
        except Exception as exc:  # logged, backed off: a reconcile never stops the loop
            delay = self.queue.add_rate_limited(instance_id)
            self.metrics.reconciles.labels("error").inc()
            log.warning("reconcile_error instance=%s in_s=%.1f error=%r", instance_id, delay, exc)
            self._logged[instance_id] = (time.monotonic(), "error")
            return
        self.queue.forget(instance_id)
        self.metrics.reconciles.labels("ok").inc()
        self._log_reconcile(instance_id, "ok", logging.INFO, "reconciled instance=%s reason=%s", reason)
        self.queue.add_after(instance_id, self.reconcile_every_s)

    def _log_reconcile(self, instance_id: uuid.UUID, outcome: str, level: int, msg: str, *args: Any) -> None:
        """At `level` when this instance's outcome changed or was last logged `reconcile_log_every_s` ago,
        else at DEBUG: INFO shows each instance's reconciles without one line per timer tick."""
        now = time.monotonic()
        last = self._logged.get(instance_id)
        if last is None or last[1] != outcome or now - last[0] >= self.reconcile_log_every_s:
            self._logged[instance_id] = (now, outcome)
        else:
            level = logging.DEBUG
        log.log(level, msg, instance_id, *args)
