"""Browser terminal: a WebSocket that opens an SSH pty on the allocation.

The platform holds an SSH certificate authority (one ed25519 key in `platform_keys`, shared by
every replica). Each terminal session gets a fresh key pair and a certificate for the
allocation's Unix account, valid for `terminal_cert_ttl_s`; agents trust the CA (they receive
its public key when they register). No long-lived platform key is ever installed on a host.

Frames: binary or plain-text frames from the client are keystrokes; a text frame holding JSON
`{"type": "resize", "cols": C, "rows": R}` resizes the pty; `{"type": "input", "data": "..."}`
is also input. Output is sent as binary frames. Close codes: 4401 unauthenticated, 4403
forbidden, 4404 not found, 4409 allocation not active, 4502 SSH endpoint unreachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import asyncssh
from fastapi import APIRouter, WebSocket
from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from starlette.websockets import WebSocketDisconnect

from gpuaas.allocations import service
from gpuaas.allocations.models import platform_keys
from gpuaas.contracts.enums import AllocationStatus as S
from gpuaas.kit import audit
from gpuaas.kit.auth import current_principal
from gpuaas.kit.errors import Problem
from gpuaas.kit.logging import get_logger

router = APIRouter()
log = get_logger(__name__)
CA_NAME = "terminal-ssh-ca"


@dataclass
class SshCa:
    key: asyncssh.SSHKey

    @property
    def public(self) -> str:
        return self.key.export_public_key().decode().strip()

    def session_credentials(self, username: str, ttl_s: int, key_id: str) -> tuple[asyncssh.SSHKey, Any]:
        user_key = asyncssh.generate_private_key("ssh-ed25519")
        now = int(time.time())
        cert = self.key.generate_user_certificate(
            user_key,
            key_id,
            principals=[username],
            valid_after=now - 30,
            valid_before=now + ttl_s,
            permit_x11_forwarding=False,
            permit_agent_forwarding=False,
            permit_port_forwarding=False,
        )
        return user_key, cert


async def load_ca(kit: Any) -> None:
    """Startup hook: create the platform CA once (first replica wins), then load it."""
    async with kit.sessions() as session, session.begin():
        key = asyncssh.generate_private_key("ssh-ed25519")
        await session.execute(
            pg_insert(platform_keys)
            .values(
                name=CA_NAME, private_key=key.export_private_key().decode(), public_key=key.export_public_key().decode()
            )
            .on_conflict_do_nothing()
        )
        row = (await session.execute(select(platform_keys).where(platform_keys.c.name == CA_NAME))).one()
    kit.extras["ssh_ca"] = SshCa(asyncssh.import_private_key(row.private_key))


_CLOSE = {401: 4401, 403: 4403, 404: 4404, 409: 4409}


@router.websocket("/allocations/{allocation_id}/terminal")
async def terminal(websocket: WebSocket, allocation_id: uuid.UUID) -> None:
    kit = websocket.app.state.kit
    await websocket.accept()
    try:
        principal = await current_principal(websocket)  # type: ignore[arg-type]
        async with kit.sessions() as session, session.begin():
            alloc = await service.load_allocation(session, principal, allocation_id, "allocations.read")
            await service.ssh_key_allowed_for_terminal(session, principal, alloc)
            if alloc.status != S.active or not alloc.ssh_host:
                raise Problem(f"the allocation is {alloc.status}", status=409, code="allocation_not_active")
            await audit.record(
                session,
                service=service.SERVICE,
                actor=principal,
                action="allocations.terminal.open",
                resource_type="allocation",
                resource_id=allocation_id,
                tenant_id=alloc.tenant_id,
                project_id=alloc.project_id,
            )
    except Problem as exc:
        await websocket.close(code=_CLOSE.get(exc.status, 4400), reason=f"{exc.code}: {exc.detail}"[:120])
        return

    ca: SshCa = kit.extras["ssh_ca"]
    key, cert = ca.session_credentials(
        alloc.ssh_username, kit.settings.terminal_cert_ttl_s, f"terminal:{principal.subject}:{allocation_id}"
    )
    cols = int(websocket.query_params.get("cols", 120))
    rows = int(websocket.query_params.get("rows", 32))
    try:
        conn = await asyncio.wait_for(
            asyncssh.connect(
                alloc.ssh_host,
                alloc.ssh_port,
                username=alloc.ssh_username,
                client_keys=[(key, cert)],
                known_hosts=None,
                agent_path=None,
                config=None,
            ),
            15,
        )
    except (OSError, asyncssh.Error, TimeoutError) as exc:
        log.warning("terminal_ssh_failed", allocation_id=str(allocation_id), error=str(exc))
        await websocket.close(code=4502, reason="the allocation's SSH endpoint cannot be reached")
        return
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

        out_task = asyncio.create_task(pump_out())
        in_task = asyncio.create_task(pump_in())
        try:
            await asyncio.wait({out_task, in_task}, return_when=asyncio.FIRST_COMPLETED)
        except WebSocketDisconnect:
            pass
        finally:
            for t in (out_task, in_task):
                t.cancel()
            for t in (out_task, in_task):
                with contextlib.suppress(BaseException):
                    await t
            process.close()
    with contextlib.suppress(Exception):
        await websocket.close(code=1000)
