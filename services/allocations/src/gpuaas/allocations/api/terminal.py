"""Browser terminal: a WebSocket that opens an SSH pty on the allocation.

The platform holds an SSH certificate authority (one ed25519 key in `platform_keys`, shared by
every replica, loaded at startup into `AllocationsRuntime`). Each terminal session gets a fresh key
pair and a certificate for the allocation's Unix account, valid for `terminal_cert_ttl_s`; agents
trust the CA (they receive its public key when they register). No long-lived platform key is ever installed on a host.

Frames: binary or plain-text frames from the client are keystrokes; a text frame holding JSON
`{"type": "resize", "cols": C, "rows": R}` resizes the pty; `{"type": "input", "data": "..."}`
is also input. Output is sent as binary frames. Close codes: 4401 unauthenticated, 4403
forbidden, 4404 not found, 4409 allocation not active, 4502 SSH endpoint unreachable, 4503 the
endpoint's SSH host key is not the one pinned for the host (or none is pinned): the terminal only
talks to the agent whose key was pinned at enrolment / first registration (asyncssh `known_hosts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from typing import Any

import asyncssh
from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect

from gpuaas.allocations import service
from gpuaas.allocations.runtime import AllocationsRuntime
from gpuaas.allocations.settings import Settings
from gpuaas.kit import revocation
from gpuaas.kit.app import kit_of
from gpuaas.kit.auth import current_principal
from gpuaas.kit.errors import Problem
from gpuaas.kit.logging import get_logger

router = APIRouter()
log = get_logger(__name__)


_CLOSE = {401: 4401, 403: 4403, 404: 4404, 409: 4409}


@router.websocket("/allocations/{allocation_id}/terminal")
async def terminal(websocket: WebSocket, allocation_id: uuid.UUID) -> None:
    kit = kit_of(websocket)
    await websocket.accept()
    try:
        principal = await current_principal(websocket)
        async with kit.sessions() as session, session.begin():
            target = await service.open_terminal(session, principal, allocation_id)
            project_id = await service.terminal_still_allowed(session, principal, allocation_id)
    except Problem as exc:
        await websocket.close(code=_CLOSE.get(exc.status, 4400), reason=f"{exc.code}: {exc.detail}"[:120])
        return

    key, cert = kit.state_as(AllocationsRuntime).terminal_ca.session_credentials(
        target.username, kit.settings_as(Settings).terminal_cert_ttl_s, f"terminal:{principal.subject}:{allocation_id}"
    )
    cols = int(websocket.query_params.get("cols", 120))
    rows = int(websocket.query_params.get("rows", 32))
    if not target.host_key:
        await websocket.close(code=4503, reason="the host's SSH host key is not pinned; its agent must re-register")
        return
    try:
        conn = await asyncio.wait_for(
            asyncssh.connect(
                target.host,
                target.port,
                username=target.username,
                client_keys=[(key, cert)],
                known_hosts=([asyncssh.import_public_key(target.host_key)], [], []),
                agent_path=None,
                config=None,
            ),
            15,
        )
    except asyncssh.HostKeyNotVerifiable as exc:
        log.warning("terminal_host_key_refused", allocation_id=str(allocation_id), error=str(exc))
        await websocket.close(code=4503, reason="the SSH endpoint's host key is not the pinned one")
        return
    except (OSError, asyncssh.Error, TimeoutError) as exc:
        log.warning("terminal_ssh_failed", allocation_id=str(allocation_id), error=str(exc))
        await websocket.close(code=4502, reason="the allocation's SSH endpoint cannot be reached")
        return
    watch: asyncio.Task[Problem] | None = None  # set before `async with`: the checker cannot see it always runs
    async with conn:
        process = await conn.create_process(term_type="xterm-256color", term_size=(cols, rows), encoding=None)

        async def pump_out() -> None:
            while True:
                data = await process.stdout.read(65536)
                if not data:
                    break
                await websocket.send_bytes(data)

        async def pump_in() -> None:
            while True:
                msg = await websocket.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                if msg.get("bytes") is not None:
                    process.stdin.write(msg["bytes"])
                    continue
                text = msg.get("text") or ""
                control = None
                if text.startswith("{"):
                    with contextlib.suppress(ValueError):
                        control = json.loads(text)
                if isinstance(control, dict) and control.get("type") == "resize":
                    process.change_terminal_size(int(control.get("cols", cols)), int(control.get("rows", rows)))
                elif isinstance(control, dict) and control.get("type") == "input":
                    process.stdin.write(str(control.get("data", "")).encode())
                else:
                    process.stdin.write(text.encode())

        async def still_allowed() -> None:
            async with kit.sessions() as session:
                await service.terminal_still_allowed(session, principal, allocation_id)

        out_task = asyncio.create_task(pump_out())
        in_task = asyncio.create_task(pump_in())
        tasks: set[asyncio.Task[Any]] = {out_task, in_task}
        if kit.revocations is not None:
            watch = asyncio.create_task(
                revocation.until_access_lost(kit.revocations, principal, still_allowed, keys=[project_id])
            )
            tasks.add(watch)
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        except WebSocketDisconnect:
            pass
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(BaseException):
                    await t
            process.close()
    if watch is not None and watch.done() and not watch.cancelled() and watch.exception() is None:
        lost = watch.result()
        log.info("terminal_closed_access_lost", allocation_id=str(allocation_id), code=lost.code)
        with contextlib.suppress(Exception):
            await websocket.close(
                code=revocation.websocket_close_code(lost), reason=f"{lost.code}: {lost.detail}"[:120]
            )
        return
    with contextlib.suppress(Exception):
        await websocket.close(code=1000)
