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
from contextlib import suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from gpuaas.node_agent import __version__
from gpuaas.node_agent.gpus import discover
from gpuaas.node_agent.settings import AgentSettings
from gpuaas.node_agent.sshd import Endpoint
from gpuaas.node_agent.workspace import Workspaces, kill_all

log = logging.getLogger("gpuaas.node_agent")
JOURNAL_KEEP = 2000


class TaskFailed(Exception):
    pass


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
        self.journal = Journal(self.state_dir / "journal.json")
        self.ca_public_key: str | None = None
        self.endpoint = Endpoint(self.workspaces, self.state_dir / "ssh_host_ed25519_key", lambda: self.ca_public_key)
        self.client = httpx.AsyncClient(
            base_url=settings.server_url.rstrip("/"),
            headers={"Authorization": f"Bearer {settings.node_token.get_secret_value()}"},
            timeout=httpx.Timeout(10.0, read=settings.long_poll_s + 15),
        )
        self.host_id: str | None = None
        self.ssh_port = 0
        self.heartbeat_interval = settings.heartbeat_interval_s  # the service's value once registered
        self.failures = self._parse_failures(settings.inject_failures)
        self.stopping = asyncio.Event()
        self.registered = asyncio.Event()

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

    async def register(self) -> None:
        gpus, source = await asyncio.to_thread(discover, self.s.nvidia_smi, self.s.gpus, self.s.prefer_nvidia_smi)
        body = {
            "agent_version": __version__,
            "gpus": [g.model_dump(mode="json") for g in gpus],
            "inventory_source": source,
            "ssh_host": self.s.ssh_advertise_host or self.s.ssh_bind,
            "ssh_port": self.ssh_port,
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
            except Exception as exc:
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

    async def _do_provision(self, task: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
        t0 = datetime.now(UTC)
        ws = self.workspaces.provision(p)
        await self.step(
            task,
            "workspace",
            f"account {p['username']} and workspace ready; CUDA_VISIBLE_DEVICES={ws.env()['CUDA_VISIBLE_DEVICES']}",
            started_at=t0,
        )
        await self.step(task, "keys", f"{len(p.get('authorized_keys', []))} authorized key(s) installed")
        if p.get("volumes"):
            await self.step(task, "volumes", f"{len(p['volumes'])} volume(s) mounted")
        self.workspaces.activate(ws)
        return {
            "ssh_host": self.s.ssh_advertise_host or self.s.ssh_bind,
            "ssh_port": self.ssh_port,
            "username": p["username"],
        }

    async def _interrupt(self, allocation_id: str, username: str) -> int:
        """Close the account's SSH sessions and kill every process of the allocation; the sessions closed."""
        sessions = self.endpoint.disconnect(username)
        survivors = await asyncio.to_thread(kill_all, allocation_id)
        if survivors:
            raise TaskFailed(f"processes {survivors} of the allocation survived SIGKILL")
        return sessions

    async def _do_restart(self, task: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
        ws = self.workspaces.get(p["allocation_id"])
        if not ws.root.exists():
            raise TaskFailed("the allocation's workspace is missing on this host")
        ws.write_meta(status="restarting")
        sessions = await self._interrupt(p["allocation_id"], p["username"])
        await self.step(task, "interrupt", f"{sessions} SSH session(s) closed, every process stopped")
        self.workspaces.write_keys(ws, p.get("authorized_keys", []))
        self.workspaces.set_gpus(ws, p.get("gpu_indices", []))
        for v in p.get("volumes", []):
            self.workspaces.mount(ws, v["volume_id"], v["mount_path"])
        self.workspaces.activate(ws)
        await self.step(task, "start", "workspace, keys and volumes re-applied")
        return {}

    async def _do_resize(self, task: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
        ws = self.workspaces.get(p["allocation_id"])
        if not ws.root.exists():
            raise TaskFailed("the allocation's workspace is missing on this host")
        self.workspaces.set_gpus(ws, p["gpu_indices"])
        await self.step(
            task, "gpus", "CUDA_VISIBLE_DEVICES=" + ",".join(map(str, p["gpu_indices"])) + " for new sessions"
        )
        return {"gpu_indices": p["gpu_indices"]}

    async def _do_sync_ssh_keys(self, task: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
        ws = self.workspaces.get(p["allocation_id"])
        if not ws.root.exists():
            return {"skipped": "no workspace"}
        self.workspaces.write_keys(ws, p.get("authorized_keys", []))
        return {"keys": len(p.get("authorized_keys", []))}

    async def _do_attach_volume(self, task: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
        link = self.workspaces.mount(self.workspaces.get(p["allocation_id"]), p["volume_id"], p["mount_path"])
        return {"mounted_at": str(link)}

    async def _do_detach_volume(self, task: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
        self.workspaces.unmount(
            self.workspaces.get(p["allocation_id"]),
            p["volume_id"],
            p["mount_path"],
            delete_data=bool(p.get("delete_data")),
        )
        return {}

    async def _do_release(self, task: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
        ws = self.workspaces.get(p["allocation_id"])
        if ws.root.exists():
            ws.write_meta(status="releasing")  # no new logins from here on
        sessions = await self._interrupt(p["allocation_id"], p["username"])
        await self.step(task, "processes", f"{sessions} SSH session(s) closed; no process of the allocation left")
        deleted = 0
        for v in p.get("volumes", []):
            if ws.root.exists():
                self.workspaces.unmount(ws, v["volume_id"], f"/volumes/{v['volume_id']}", delete_data=False)
            if v.get("delete_data"):
                self.workspaces.unmount(ws, v["volume_id"], "/", delete_data=True)
                deleted += 1
        if ws.root.exists():
            await asyncio.to_thread(self.workspaces.remove, ws)
        if ws.root.exists() or (await asyncio.to_thread(kill_all, p["allocation_id"], 1.0)):
            raise TaskFailed("verification failed: the workspace or a process of the allocation is still there")
        await self.step(
            task,
            "verify",
            f"keys, workspace and scratch removed; {deleted} non-persistent volume(s) "
            "deleted; verified nothing is left",
        )
        return {"verified": True}
