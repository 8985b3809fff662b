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
from contextlib import suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from gpuaas.node_agent import __version__
from gpuaas.node_agent.drivers import choose
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


class Journal:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.entries: dict[str, dict[str, Any]] = json.loads(path.read_text())
        except (OSError, ValueError):
            self.entries = {}

    def get(self, task_id: str) -> dict[str, Any] | None:
        return self.entries.get(task_id)

    def put(self, task_id: str, outcome: dict[str, Any]) -> None:
        self.entries[task_id] = outcome
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
        self.reconciled: dict[str, Any] = {}
        self.client = httpx.AsyncClient(
            base_url=settings.server_url.rstrip("/"),
            headers={"Authorization": f"Bearer {read_node_token(settings)}"},
            timeout=httpx.Timeout(10.0, read=settings.long_poll_s + 15),
        )
        self.host_id: str | None = None
        self.ssh_port = 0
        self.heartbeat_interval = settings.heartbeat_interval_s  # the service's value once registered
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
        out = {}
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
        body = {
            "agent_version": __version__,
            "gpus": [g.model_dump(mode="json") for g in gpus],
            "inventory_source": source,
            "ssh_host": self.s.ssh_advertise_host or self.s.ssh_bind,
            "ssh_port": self.ssh_port,
            "driver": self.driver.name,
            "isolates_tenants": self.driver.isolates_tenants,
            "cpu_count": os.cpu_count() or 1,
            "memory_mb": _memory_mb(),
            "ssh_host_key": self.endpoint.host_public_key,
            "reconciled": self.reconciled,
        }
        delay = 0.5
        while not self.stopping.is_set():
            try:
                r = await self.client.post("/agent/register", json=body)
                if r.status_code == 200:
                    data = r.json()
                    self.host_id = data["host_id"]
                    self.ca_public_key = data["ssh_ca_public_key"]
                    self.heartbeat_interval = float(data.get("heartbeat_interval_s") or self.s.heartbeat_interval_s)
                    self.registered.set()
                    log.info(
                        "registered as host %s (%s, %d GPUs from %s)", data["name"], self.host_id, len(gpus), source
                    )
                    return
                log.error("registration refused: %s %s", r.status_code, r.text[:300])
            except httpx.HTTPError as exc:
                log.warning("allocations unreachable: %s", exc)
            await wait_or_stop(self.stopping, delay)
            delay = min(delay * 2, 10)

    async def _heartbeats(self) -> None:
        while not await wait_or_stop(self.stopping, self.heartbeat_interval):
            try:
                r = await self.client.post("/agent/heartbeat")
                if r.status_code == 401:
                    log.error("heartbeat refused: the node token is no longer valid")
            except httpx.HTTPError as exc:
                log.warning("heartbeat failed: %s", exc)

    async def _task_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                r = await self.client.get("/agent/tasks", params={"wait_s": self.s.long_poll_s})
                r.raise_for_status()
                tasks = r.json()
            except httpx.HTTPError as exc:
                log.warning("task poll failed: %s", exc)
                await wait_or_stop(self.stopping, 1)
                continue
            for task in tasks:
                await self.handle(task)

    # ------------------------------------------------------------------------------------------ tasks

    async def handle(self, task: dict[str, Any]) -> None:
        task_id = task["task_id"]
        outcome = self.journal.get(task_id)
        if outcome is None:
            started = time.monotonic()
            try:
                result = await self.execute(task)
                outcome = {
                    "ok": True,
                    "message": f"{task['kind']} done in {time.monotonic() - started:.2f}s",
                    "result": result,
                }
            except Exception as exc:  # TaskFailed, DriverError, OSError...: the reason goes to the control plane
                outcome = {"ok": False, "message": str(exc) or exc.__class__.__name__, "result": {}}
            self.journal.put(task_id, outcome)
        await self._report(task_id, outcome)

    async def _report(self, task_id: str, outcome: dict[str, Any]) -> None:
        """Retry until the service has the outcome; on a shutdown the journal keeps it for the next run."""
        delay = 0.2
        while True:
            try:
                r = await self.client.post(f"/agent/tasks/{task_id}/complete", json=outcome)
                if r.status_code < 500 and r.status_code != 429:
                    return  # 200 applied or already applied; 404 means the task is not ours any more
            except httpx.HTTPError as exc:
                log.warning("completion report failed (will retry): %s", exc)
            if await wait_or_stop(self.stopping, delay):
                return
            delay = min(delay * 2, 5)

    async def step(
        self,
        task: dict[str, Any],
        phase: str,
        message: str,
        *,
        status: str = "succeeded",
        started_at: datetime | None = None,
    ) -> None:
        body = {
            "phase": phase,
            "status": status,
            "message": message,
            "started_at": (started_at or datetime.now(UTC)).isoformat(),
            "finished_at": datetime.now(UTC).isoformat(),
        }
        try:
            await self.client.post(f"/agent/tasks/{task['task_id']}/progress", json=body)
        except httpx.HTTPError:
            pass  # progress is informative; the outcome report is what must arrive

    def _maybe_fail(self, kind: str) -> None:
        if self.failures.get(kind, 0) > 0:
            self.failures[kind] -= 1
            raise TaskFailed(f"injected failure of {kind} (GPUAAS_AGENT_INJECT_FAILURES)")

    async def execute(self, task: dict[str, Any]) -> dict[str, Any]:
        kind, p = task["kind"], task["payload"]
        handler = getattr(self, f"_do_{kind}", None)
        if handler is None:
            raise TaskFailed(f"this agent does not know task kind {kind!r}")
        self._maybe_fail(kind)
        return await handler(task, p) or {}

    def _workspace(self, p: dict[str, Any]) -> Workspace:
        ws = self.workspaces.get(p["allocation_id"])
        if not ws.root.exists():
            raise TaskFailed("the allocation's workspace is missing on this host")
        return ws

    async def _do_provision(self, task: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
        t0 = datetime.now(UTC)
        ws = self.workspaces.provision(p)
        await self.step(
            task, "workspace", f"workspace ready; CUDA_VISIBLE_DEVICES={ws.cuda_visible_devices()}", started_at=t0
        )
        await self.step(task, "keys", f"{len(p.get('authorized_keys', []))} authorized key(s) installed")
        t1 = datetime.now(UTC)
        message = await self.driver.provision(ws)
        await asyncio.to_thread(self.workspaces.write_marker, ws)
        await self.step(task, "runtime", message, started_at=t1)
        if p.get("volumes"):
            await self.step(task, "volumes", f"{len(p['volumes'])} volume(s) mounted")
        extra: dict[str, Any] = {}
        if p.get("workload"):  # a launchable app (issue 21): active only once its health check answers
            t2 = datetime.now(UTC)
            extra["workload"] = await self.driver.workload_endpoint(ws)
            port = extra["workload"]["host_port"]
            await self.step(task, "workload", f"workload healthy on host port {port}", started_at=t2)
        self.workspaces.activate(ws)
        return {
            **extra,
            "ssh_host": self.s.ssh_advertise_host or self.s.ssh_bind,
            "ssh_port": self.ssh_port,
            "username": p["username"],
            "driver": self.driver.name,
            "network": await self.driver.network_info(ws),
        }

    def _update(self, ws: Workspace, p: dict[str, Any]) -> None:
        """Take what a restart/resize payload carries (GPUs, limits, runtime) into the allocation's meta."""
        values = {k: p[k] for k in ("gpu_indices", "limits", "runtime") if k in p}
        if values:
            ws.write_meta(**values)

    async def _do_restart(self, task: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
        ws = self._workspace(p)
        ws.write_meta(status="restarting")
        sessions = self.endpoint.disconnect(p["username"])
        self.workspaces.write_keys(ws, p.get("authorized_keys", []))
        self._update(ws, p)
        for v in p.get("volumes", []):
            self.workspaces.add_volume(ws, v["volume_id"], v["mount_path"])
        message = await self.driver.restart(ws)
        await self.step(task, "interrupt", f"{sessions} SSH session(s) closed")
        workload_endpoint = await self.driver.workload_endpoint(ws)  # None without a launchable workload
        self.workspaces.activate(ws)
        await self.step(task, "start", message)
        return {"network": await self.driver.network_info(ws), "workload": workload_endpoint}

    async def _do_resize(self, task: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
        ws = self._workspace(p)
        self._update(ws, p)
        if self.driver.isolates_tenants:
            self.endpoint.disconnect(ws.username)  # the container is recreated with the new devices
        message = await self.driver.apply(ws, [])
        await asyncio.to_thread(self.workspaces.write_marker, ws)
        await self.step(task, "gpus", f"CUDA_VISIBLE_DEVICES={ws.cuda_visible_devices()}; {message}")
        return {"gpu_indices": ws.gpu_indices, "network": await self.driver.network_info(ws)}

    async def _do_sync_ssh_keys(self, task: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
        ws = self.workspaces.get(p["allocation_id"])
        if not ws.root.exists():
            return {"skipped": "no workspace"}
        self.workspaces.write_keys(ws, p.get("authorized_keys", []))
        return {"keys": len(p.get("authorized_keys", []))}

    async def _do_attach_volume(self, task: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
        ws = self._workspace(p)
        self.workspaces.add_volume(ws, p["volume_id"], p["mount_path"])
        if self.driver.isolates_tenants:
            self.endpoint.disconnect(ws.username)  # a bind mount needs a new container
        message = await self.driver.apply(ws, [])
        return {"mounted_at": p["mount_path"], "message": message}

    async def _do_detach_volume(self, task: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
        ws = self.workspaces.get(p["allocation_id"])
        self.workspaces.drop_volume(ws, p["volume_id"], delete_data=bool(p.get("delete_data")))
        if ws.root.exists():
            if self.driver.isolates_tenants:
                self.endpoint.disconnect(ws.username)
            await self.driver.apply(ws, [p["mount_path"]])
        return {}

    async def _do_release(self, task: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
        ws = self.workspaces.get(p["allocation_id"])
        if ws.root.exists():
            ws.write_meta(status="releasing")  # no new logins from here on
        sessions = self.endpoint.disconnect(p["username"])
        await self.step(task, "processes", f"{sessions} SSH session(s) closed")
        evidence = await self.driver.release(ws)
        deleted = 0
        for v in p.get("volumes", []):
            if v.get("delete_data"):
                self.workspaces.drop_volume(ws, v["volume_id"], delete_data=True)
                deleted += 1
        await self.step(
            task,
            "verify",
            f"{self.driver.name}: removed and verified ({len(evidence.get('checked', []))} checks); "
            f"{deleted} non-persistent volume(s) deleted",
        )
        return {"verified": True, "evidence": evidence}
