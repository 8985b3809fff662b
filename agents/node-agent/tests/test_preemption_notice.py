"""A preemption's notice and stop on the node agent (issue 29 item 4), process driver: `notify_preemption`
writes the notice (JSON: deadline, reason, on_preemption) where the allocation reads it and a message to each
open SSH session (stdout with a pty, stderr without); a release with `stop_timeout_s` sends SIGTERM first (a job
that traps it gets to clean up) and SIGKILLs what ignores it once the stop timeout has passed."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncssh
from agent_harness import Host


async def _open(h: Host, username: str, command: str, term: str | None) -> asyncssh.SSHClientProcess[str]:
    conn = await asyncssh.connect(
        "127.0.0.1", h.port, username=username, client_keys=[h.keys[username]], known_hosts=None
    )
    return await conn.create_process(command, term_type=term)


async def _read_until(stream: asyncssh.SSHReader[str], needle: str, timeout_s: float = 10) -> str:
    seen = ""
    deadline = time.monotonic() + timeout_s
    while needle not in seen:
        seen += await asyncio.wait_for(stream.read(4096), max(deadline - time.monotonic(), 0.01))
    return seen


async def test_notice_reaches_the_workspace_and_sessions_then_sigterm_before_sigkill(
    process_host: Host, tmp_path: Path
) -> None:
    h = process_host
    p = h.payload("pia", [0])
    await h.task("provision", p)
    marker = tmp_path / "got-term"
    with_pty = await _open(
        h, "pia", f"echo ready; trap 'echo term > {marker}; exit 0' TERM; while :; do sleep 0.1; done", "xterm"
    )
    plain = await _open(h, "pia", "echo ready; trap '' TERM; while :; do sleep 0.1; done", None)
    await _read_until(with_pty.stdout, "ready")
    await _read_until(plain.stdout, "ready")
    deadline = datetime.now(UTC) + timedelta(seconds=30)

    result = await h.task(
        "notify_preemption",
        {
            "allocation_id": p["allocation_id"],
            "username": "pia",
            "deadline": deadline.isoformat(),
            "reason": "reclaim_guarantee",
        },
    )

    assert result["file_written"] is True and result["sessions_notified"] == 2, result
    home = h.agent.workspaces.get(p["allocation_id"]).home
    notice = json.loads((home / ".gpuaas-preemption").read_text())
    assert datetime.fromisoformat(notice["deadline"].replace("Z", "+00:00")) == deadline
    assert (notice["reason"], notice["on_preemption"]) == ("reclaim_guarantee", "release")
    assert "preempted (reclaim_guarantee)" in await _read_until(with_pty.stdout, "Save your work")
    assert "preempted (reclaim_guarantee)" in await _read_until(plain.stderr, "Save your work")

    started = time.monotonic()
    released = await h.task(
        "release", {"allocation_id": p["allocation_id"], "username": "pia", "volumes": [], "stop_timeout_s": 1.5}
    )
    took = time.monotonic() - started

    assert marker.read_text().strip() == "term"  # the trapping job got SIGTERM and cleaned up
    assert took >= 1.5  # the job ignoring SIGTERM was given the stop timeout, then killed by the release
    assert released["evidence"]["processes_left"] == [] and released["evidence"]["cgroup_empty"] is True


async def test_container_notice_file_in_run_gpuaas_and_podman_stop_timeout(
    container_host: Host, runtime: dict[str, str]
) -> None:
    h = container_host
    p = h.payload("cora", [0], runtime)
    await h.task("provision", p)
    deadline = datetime.now(UTC) + timedelta(seconds=30)

    result = await h.task(
        "notify_preemption",
        {
            "allocation_id": p["allocation_id"],
            "username": "cora",
            "deadline": deadline.isoformat(),
            "reason": "reclaim_guarantee",
            "on_preemption": "requeue",
        },
    )

    assert result["file_written"] is True and result["sessions_notified"] == 0, result
    seen = await h.ssh("cora", "cat /run/gpuaas/preemption; stat -c %a /run/gpuaas/preemption")
    notice = json.loads(seen.stdout.splitlines()[0])
    assert datetime.fromisoformat(notice["deadline"].replace("Z", "+00:00")) == deadline
    assert notice["on_preemption"] == "requeue" and seen.stdout.splitlines()[1] == "644"
    released = await h.task(
        "release", {"allocation_id": p["allocation_id"], "username": "cora", "volumes": [], "stop_timeout_s": 1}
    )
    assert released["evidence"]["container_removed"] is True
