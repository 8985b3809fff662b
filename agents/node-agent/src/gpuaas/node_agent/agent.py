"""The agent's loops: register, heartbeat, long-poll tasks, execute them in order, report.

Exactly-once effects across restarts (of the agent and of the service):
- tasks are leased by the service; an unreported lease returns to the queue (at the agent's next
  registration at once, otherwise when the lease expires);
- before reporting, the agent writes the outcome to its journal (`<state>/journal.json`); a task
  it meets again that is in the journal is *reported*, not executed again;
- a task interrupted before its outcome was journaled runs again, and every task is idempotent
  (mkdir -p, write-and-rename, kill-and-verify, remove-if-present);
- the service applies a completion once (a repeated report is a no-op).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import httpx
from pydantic import ValidationError

from gpuaas.contracts.agent import (
    TASK_TYPES,
    AgentRegistered,
    AgentRegistration,
    AgentResult,
    AttachVolumeResult,
    AttachVolumeTask,
    DetachVolumeResult,
    DetachVolumeTask,
    HeartbeatAck,
    NetworkInfo,
    NotifyPreemptionResult,
    NotifyPreemptionTask,
    OverlaySpec,
    ProvisionResult,
    ProvisionTask,
    ReleaseEvidence,
    ReleaseResult,
    ReleaseTask,
    ResizeResult,
    ResizeTask,
    RestartResult,
    RestartTask,
    SyncSshKeysResult,
    SyncSshKeysTask,
    TaskCompletion,
    TaskInput,
    TaskLease,
    TaskProgress,
    WorkloadReport,
    complete_table,
)
from gpuaas.node_agent import __version__
from gpuaas.node_agent.drivers import choose
from gpuaas.node_agent.drivers.base import DriverError
from gpuaas.node_agent.gpus import discover
from gpuaas.node_agent.settings import AgentSettings, read_node_token
from gpuaas.node_agent.sshd import Endpoint
from gpuaas.node_agent.workspace import Workspace, Workspaces

log = logging.getLogger("gpuaas.node_agent")
JOURNAL_KEEP = 2000


class TaskFailed(Exception):
    pass


def _memory_mb() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


async def wait_or_stop(stopping: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds`, waking at once when `stopping` is set; True when it was (every loop's pause)."""
    with suppress(TimeoutError):
        await asyncio.wait_for(stopping.wait(), seconds)
    return stopping.is_set()


def _reportable(message: str) -> str:
    """A message the service accepts (`Text`): no control characters but newline and tab, at most 4000."""
    return "".join(ch if ch in "\n\t" or ch.isprintable() else "?" for ch in message)[:4000]


class Journal:
    """Each reported task's outcome (the completion body), kept across restarts until reported."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.entries: dict[str, object] = json.loads(path.read_text())
        except (OSError, ValueError):
            self.entries = {}

    def get(self, task_id: str) -> TaskCompletion | None:
        entry = self.entries.get(task_id)
        if entry is None:
            return None
        try:
            return TaskCompletion.model_validate(entry)
        except ValidationError:  # unreadable (hand-edited, say): the task runs again, as every task is idempotent
            return None

    def put(self, task_id: str, outcome: TaskCompletion) -> None:
        self.entries[task_id] = outcome.model_dump(mode="json", exclude_unset=True)
        if len(self.entries) > JOURNAL_KEEP:
            for k in list(self.entries)[: len(self.entries) - JOURNAL_KEEP]:
                del self.entries[k]
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(self.entries, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


class Agent:
    def __init__(self, settings: AgentSettings) -> None:
        self.s = settings
        self.state_dir = settings.state_dir.absolute()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.workspaces = Workspaces(self.state_dir)
        self.agent_id = self._agent_id()
        self.driver = choose(settings, self.workspaces, self.agent_id, self.state_dir)
        self.journal = Journal(self.state_dir / "journal.json")
        self.ca_public_key: str | None = None
        self.endpoint = Endpoint(
            self.workspaces, self.driver, self.state_dir / "ssh_host_ed25519_key", lambda: self.ca_public_key
        )
        self.reconciled: dict[str, Any] = {}  # the driver's report, logged and sent with the registration
        self.client = httpx.AsyncClient(
            base_url=settings.server_url.rstrip("/"),
            headers={"Authorization": f"Bearer {read_node_token(settings)}"},
            timeout=httpx.Timeout(10.0, read=settings.long_poll_s + 15),
        )
        self.host_id: str | None = None
        self.ssh_port = 0
        self.heartbeat_interval = settings.heartbeat_interval_s  # the service's value once registered
        self.overlays: dict[str, str] = {}  # project id -> the segment last applied (JSON): applied again on change
        self.failures = self._parse_failures(settings.inject_failures)
        self.stopping = asyncio.Event()
        self.registered = asyncio.Event()

    def _agent_id(self) -> str:
        """A stable id of this agent (its state dir): the label of its containers, the kind of its CDI spec."""
        path = self.state_dir / "agent_id"
        try:
            return path.read_text().strip()
        except OSError:
            value = uuid.uuid4().hex[:12]
            path.write_text(value)
            return value

    @staticmethod
    def _parse_failures(spec: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            kind, _, n = part.partition(":")
            out[kind] = int(n or 1)
        return out

    # ------------------------------------------------------------------------------------------- run

    async def run(self) -> None:
        port = self.s.ssh_port or self._remembered_port()
        self.ssh_port = await self.endpoint.start(self.s.ssh_bind, port)
        (self.state_dir / "ssh_port").write_text(str(self.ssh_port))
        log.info("ssh endpoint on %s:%s, host key %s", self.s.ssh_bind, self.ssh_port, self.endpoint.host_public_key)
        try:
            await self.reconcile()
            await self.register()
            beats = asyncio.create_task(self._heartbeats())
            try:
                await self._task_loop()
            finally:
                beats.cancel()
        finally:
            self.stopping.set()
            await self.endpoint.stop()
            await self.client.aclose()

    def _remembered_port(self) -> int:
        try:
            return int((self.state_dir / "ssh_port").read_text())
        except (OSError, ValueError):
            return 0

    async def reconcile(self) -> None:
        """Before taking tasks: remove what this agent runs but does not know, bring back what it should run.
        The report is logged and sent with the registration (`reconciled`)."""
        gpus, source = await asyncio.to_thread(discover, self.s.nvidia_smi, self.s.gpus, self.s.prefer_nvidia_smi)
        self.driver.set_inventory(gpus, source)
        try:
            self.reconciled = await self.driver.reconcile()
        except Exception as exc:  # the agent still registers; the failure is in the report
            self.reconciled = {"driver": self.driver.name, "error": str(exc)}
        log.info("reconciled (%s driver): %s", self.driver.name, json.dumps(self.reconciled))

    async def register(self) -> None:
        gpus, source = await asyncio.to_thread(discover, self.s.nvidia_smi, self.s.gpus, self.s.prefer_nvidia_smi)
        self.driver.set_inventory(gpus, source)
        body = AgentRegistration.model_validate(
            {
                "agent_version": __version__,
                "gpus": gpus,
                "inventory_source": source,
                "ssh_host": self.s.ssh_advertise_host or self.s.ssh_bind,
                "ssh_port": self.ssh_port,
                "driver": self.driver.name,
                "isolates_tenants": self.driver.isolates_tenants,
                "cpu_count": os.cpu_count() or 1,
                "memory_mb": _memory_mb() or None,
                "ssh_host_key": self.endpoint.host_public_key,
                "reconciled": json.loads(json.dumps(self.reconciled, default=str)),
            }
        )
        delay = 0.5
        while not self.stopping.is_set():
            try:
                r = await self.client.post("/agent/register", json=body.model_dump(mode="json", exclude_none=True))
                if r.status_code == 200:
                    data = AgentRegistered.model_validate_json(r.content)
                    self.host_id = str(data.host_id)
                    self.ca_public_key = data.ssh_ca_public_key
                    self.heartbeat_interval = data.heartbeat_interval_s or self.s.heartbeat_interval_s
                    self.registered.set()
                    log.info("registered as host %s (%s, %d GPUs from %s)", data.name, self.host_id, len(gpus), source)
                    return
                log.error("registration refused: %s %s", r.status_code, r.text[:300])
            except (httpx.HTTPError, ValidationError) as exc:
                log.warning("allocations unreachable or answering out of protocol: %s", exc)
            await wait_or_stop(self.stopping, delay)
            delay = min(delay * 2, 10)

    async def _heartbeats(self) -> None:
        while not await wait_or_stop(self.stopping, self.heartbeat_interval):
            try:
                r = await self.client.post("/agent/heartbeat")
                if r.status_code == 401:
                    log.error("heartbeat refused: the node token is no longer valid")
                elif r.is_success:
                    await self.apply_overlays(HeartbeatAck.model_validate_json(r.content).overlays)
            except (httpx.HTTPError, ValidationError) as exc:
                log.warning("heartbeat failed: %s", exc)

    async def apply_overlays(self, segments: list[OverlaySpec] | None) -> None:
        """The heartbeat's answer: this host's project segments as they are now. Each changed one is applied
        (peers and names follow members coming and going); None (an older service) changes nothing."""
        for seg in segments or []:
            key, text = str(seg.project_id), seg.model_dump_json()
            if seg.project_id is None or self.overlays.get(key) == text:
                continue
            try:
                if await self.driver.sync_overlay(key, seg) is not None:  # else no network yet: the next beat
                    self.overlays[key] = text
            except DriverError as exc:  # the next heartbeat tries again
                log.warning("overlay of project %s not applied: %s", key, exc)
        live = {str(s.project_id) for s in segments or []}
        if segments is not None:
            self.overlays = {k: v for k, v in self.overlays.items() if k in live}

    async def _task_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                r = await self.client.get("/agent/tasks", params={"wait_s": self.s.long_poll_s})
                r.raise_for_status()
                answer: object = r.json()
                if not isinstance(answer, list):
                    raise ValueError("the task poll answered no list")
                leased = cast(list[object], answer)
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("task poll failed: %s", exc)
                await wait_or_stop(self.stopping, 1)
                continue
            for raw in leased:
                await self.handle_raw(raw)

    # ------------------------------------------------------------------------------------------ tasks

    async def handle_raw(self, raw: object) -> None:
        """One leased task as it arrived: a task this agent cannot read (a kind added after it, a malformed
        payload) is reported failed with the reason, as the control plane expects of an older agent."""
        try:
            lease = TaskLease.model_validate(raw)
        except ValidationError as exc:
            fields = cast(dict[str, object], raw) if isinstance(raw, dict) else {}
            task_id, kind = fields.get("task_id"), fields.get("kind")
            log.error("cannot read task %s (%s): %s", task_id, kind, exc)
            if isinstance(task_id, str):
                reason = f"this agent ({__version__}) cannot read task kind {kind!r}: {exc.errors()[0]['msg']}"
                await self._report(task_id, TaskCompletion(ok=False, message=_reportable(reason)))
            return
        await self.handle(lease)

    async def handle(self, lease: TaskLease) -> None:
        task_id = str(lease.task_id)
        outcome = self.journal.get(task_id)
        if outcome is None:
            started = time.monotonic()
            try:
                result = await self.execute(lease)
                outcome = TaskCompletion(
                    ok=True,
                    message=f"{lease.kind} done in {time.monotonic() - started:.2f}s",
                    # what was set, and always the kind (the service reads a result without one by the task's)
                    result={"kind": result.kind, **result.model_dump(mode="json", exclude_unset=True)},
                )
            except Exception as exc:  # TaskFailed, DriverError, OSError...: the reason goes to the control plane
                outcome = TaskCompletion(ok=False, message=_reportable(str(exc) or exc.__class__.__name__))
            self.journal.put(task_id, outcome)
        await self._report(task_id, outcome)

    async def _report(self, task_id: str, outcome: TaskCompletion) -> None:
        """Retry until the service has the outcome; on a shutdown the journal keeps it for the next run."""
        delay = 0.2
        body = outcome.model_dump(mode="json")
        while True:
            try:
                r = await self.client.post(f"/agent/tasks/{task_id}/complete", json=body)
                if r.status_code < 500 and r.status_code != 429:
                    return  # 200 applied or already applied; 404 means the task is not ours any more
            except httpx.HTTPError as exc:
                log.warning("completion report failed (will retry): %s", exc)
            if await wait_or_stop(self.stopping, delay):
                return
            delay = min(delay * 2, 5)

    async def step(
        self,
        lease: TaskLease,
        phase: str,
        message: str,
        *,
        status: str = "succeeded",
        started_at: datetime | None = None,
    ) -> None:
        body = TaskProgress.model_validate(
            {
                "phase": phase,
                "status": status,
                "message": _reportable(message)[:2000],
                "started_at": started_at or datetime.now(UTC),
                "finished_at": datetime.now(UTC),
            }
        )
        try:
            await self.client.post(f"/agent/tasks/{lease.task_id}/progress", json=body.model_dump(mode="json"))
        except httpx.HTTPError:
            pass  # progress is informative; the outcome report is what must arrive

    def _maybe_fail(self, kind: str) -> None:
        if self.failures.get(kind, 0) > 0:
            self.failures[kind] -= 1
            raise TaskFailed(f"injected failure of {kind} (GPUAAS_AGENT_INJECT_FAILURES)")

    async def execute(self, lease: TaskLease) -> AgentResult:
        """Run the lease's task by its handler (the table below, keyed by the task's model type)."""
        self._maybe_fail(lease.kind)
        return await HANDLERS[type(lease.payload)](self, lease, lease.payload)

    def _workspace(self, p: TaskInput) -> Workspace:
        ws = self.workspaces.get(str(p.allocation_id))
        if not ws.root.exists():
            raise TaskFailed("the allocation's workspace is missing on this host")
        return ws

    async def _network(self, ws: Workspace) -> NetworkInfo | None:
        info = await self.driver.network_info(ws)
        return NetworkInfo.model_validate(info) if info else None

    async def _workload(self, ws: Workspace) -> WorkloadReport | None:
        endpoint = await self.driver.workload_endpoint(ws)  # None without a launchable workload
        return WorkloadReport.model_validate(endpoint) if endpoint else None

    async def run_provision(self, lease: TaskLease, p: ProvisionTask) -> ProvisionResult:
        t0 = datetime.now(UTC)
        ws = self.workspaces.provision(p)
        await self.step(
            lease, "workspace", f"workspace ready; CUDA_VISIBLE_DEVICES={ws.cuda_visible_devices()}", started_at=t0
        )
        await self.step(lease, "keys", f"{len(p.authorized_keys)} authorized key(s) installed")
        t1 = datetime.now(UTC)
        message = await self.driver.provision(ws)
        await asyncio.to_thread(self.workspaces.write_marker, ws)
        await self.step(lease, "runtime", message, started_at=t1)
        if p.volumes:
            await self.step(lease, "volumes", f"{len(p.volumes)} volume(s) mounted")
        result = ProvisionResult(
            ssh_host=self.s.ssh_advertise_host or self.s.ssh_bind,
            ssh_port=self.ssh_port,
            username=p.username,
            driver=self.driver.name,
        )
        if p.workload:  # a launchable app (issue 21): active only once its health check answers
            t2 = datetime.now(UTC)
            result.workload = await self._workload(ws)
            port = result.workload.host_port if result.workload else None
            await self.step(lease, "workload", f"workload healthy on host port {port}", started_at=t2)
        self.workspaces.activate(ws)
        result.network = await self._network(ws)
        return result

    @staticmethod
    def _update(ws: Workspace, p: RestartTask | ResizeTask) -> None:
        """Take what a restart/resize payload carries (GPUs, limits, runtime, overlay) into the allocation's meta; a
        field the control plane did not send keeps its value. An overlay sent as null keeps it too: the address is
        the allocation's for its life (a resize that sent null moved a member off its segment, and the project's
        next member then found the network on another subnet)."""
        values = p.model_dump(mode="json", include={"gpu_indices", "limits", "runtime", "overlay"} & p.model_fields_set)
        if values.get("overlay", ...) is None:
            del values["overlay"]
        if values:
            ws.write_meta(**values)

    async def run_restart(self, lease: TaskLease, p: RestartTask) -> RestartResult:
        ws = self._workspace(p)
        ws.write_meta(status="restarting")
        sessions = self.endpoint.disconnect(p.username)
        self.workspaces.write_keys(ws, p.authorized_keys)
        self._update(ws, p)
        for v in p.volumes:
            self.workspaces.add_volume(ws, str(v.volume_id), v.mount_path)
        message = await self.driver.restart(ws)
        await self.step(lease, "interrupt", f"{sessions} SSH session(s) closed")
        workload = await self._workload(ws)
        self.workspaces.activate(ws)
        await self.step(lease, "start", message)
        return RestartResult(network=await self._network(ws), workload=workload)

    async def run_resize(self, lease: TaskLease, p: ResizeTask) -> ResizeResult:
        ws = self._workspace(p)
        self._update(ws, p)
        if self.driver.isolates_tenants:
            self.endpoint.disconnect(ws.username)  # the container is recreated with the new devices
        message = await self.driver.apply(ws, [])
        await asyncio.to_thread(self.workspaces.write_marker, ws)
        await self.step(lease, "gpus", f"CUDA_VISIBLE_DEVICES={ws.cuda_visible_devices()}; {message}")
        return ResizeResult(gpu_indices=ws.gpu_indices, network=await self._network(ws))

    async def run_sync_ssh_keys(self, lease: TaskLease, p: SyncSshKeysTask) -> SyncSshKeysResult:
        ws = self.workspaces.get(str(p.allocation_id))
        if not ws.root.exists():
            return SyncSshKeysResult(skipped="no workspace")
        self.workspaces.write_keys(ws, p.authorized_keys)
        # A removed key's open sessions end with it (a disabled user, a removed member, a revoked grant).
        closed = await self.endpoint.end_removed_keys(p.username or ws.username, "\n".join(p.authorized_keys))
        if closed:
            await self.step(lease, "keys", f"{closed} SSH session(s) of removed keys closed")
        return SyncSshKeysResult(keys=len(p.authorized_keys), sessions_closed=closed)

    async def run_attach_volume(self, lease: TaskLease, p: AttachVolumeTask) -> AttachVolumeResult:
        ws = self._workspace(p)
        self.workspaces.add_volume(ws, str(p.volume_id), p.mount_path)
        if self.driver.isolates_tenants:
            self.endpoint.disconnect(ws.username)  # a bind mount needs a new container
        message = await self.driver.apply(ws, [])
        return AttachVolumeResult(mounted_at=p.mount_path, message=message)

    async def run_detach_volume(self, lease: TaskLease, p: DetachVolumeTask) -> DetachVolumeResult:
        ws = self.workspaces.get(str(p.allocation_id))
        self.workspaces.drop_volume(ws, str(p.volume_id), delete_data=p.delete_data)
        if ws.root.exists():
            if self.driver.isolates_tenants:
                self.endpoint.disconnect(ws.username)
            await self.driver.apply(ws, [p.mount_path])
        return DetachVolumeResult()

    async def run_notify_preemption(self, lease: TaskLease, p: NotifyPreemptionTask) -> NotifyPreemptionResult:
        """The preemption notice (issue 29): /run/gpuaas/preemption inside the allocation (JSON) and a message
        on its open SSH sessions; the stop comes later, as a release task."""
        ws = self.workspaces.get(str(p.allocation_id))
        if not ws.root.exists():
            return NotifyPreemptionResult()
        deadline = p.deadline.astimezone(UTC).isoformat().replace("+00:00", "Z")
        notice = {"deadline": deadline, "reason": p.reason, "on_preemption": p.on_preemption}
        path = await self.driver.write_notice(ws, "preemption", json.dumps(notice) + "\n")
        then = "it will be queued again" if p.on_preemption == "requeue" else "it will be released"
        told = self.endpoint.tell(
            ws.username,
            f"*** gpuaas: this allocation is preempted ({p.reason}): it stops at {deadline} "
            f"(SIGTERM, then SIGKILL); {then}. Save your work. Details: {path} ***",
        )
        await self.step(lease, "notice", f"{path} written; {told} SSH session(s) told")
        return NotifyPreemptionResult(file_written=True, sessions_notified=told)

    async def run_release(self, lease: TaskLease, p: ReleaseTask) -> ReleaseResult:
        ws = self.workspaces.get(str(p.allocation_id))
        if ws.root.exists():
            ws.write_meta(status="releasing")  # no new logins from here on
        if p.stop_timeout_s is not None and ws.root.exists():  # a preemption: SIGTERM first, SIGKILL after
            await self.driver.stop(ws, p.stop_timeout_s)
            await self.step(lease, "stop", f"stopped (SIGTERM, SIGKILL after {p.stop_timeout_s:.0f}s)")
        sessions = self.endpoint.disconnect(p.username)
        await self.step(lease, "processes", f"{sessions} SSH session(s) closed")
        evidence = ReleaseEvidence.model_validate(await self.driver.release(ws))
        deleted = 0
        for v in p.volumes:
            if v.delete_data:
                self.workspaces.drop_volume(ws, str(v.volume_id), delete_data=True)
                deleted += 1
        await self.step(
            lease,
            "verify",
            f"{self.driver.name}: removed and verified ({len(evidence.checked)} checks); "
            f"{deleted} non-persistent volume(s) deleted",
        )
        return ReleaseResult(verified=True, evidence=evidence)


# Each task type's handler, keyed by the payload's model type; a member of `AgentTask` without one fails here
# at import. The values take the payload as `Any`: each handler's own signature names its type, the key pairs them.
HANDLERS: dict[type[TaskInput], Callable[[Agent, TaskLease, Any], Awaitable[AgentResult]]] = {
    ProvisionTask: Agent.run_provision,
    RestartTask: Agent.run_restart,
    ResizeTask: Agent.run_resize,
    SyncSshKeysTask: Agent.run_sync_ssh_keys,
    AttachVolumeTask: Agent.run_attach_volume,
    DetachVolumeTask: Agent.run_detach_volume,
    ReleaseTask: Agent.run_release,
    NotifyPreemptionTask: Agent.run_notify_preemption,
}
complete_table(HANDLERS, TASK_TYPES, "node agent task handlers")
