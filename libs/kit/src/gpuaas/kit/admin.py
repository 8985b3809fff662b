"""Operator surface every service shares: dead letters (list, retry) and outbox status/replay.

Mounted at `/admin`; platform operators only. Every mutation here is audited too.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel
from sqlalchemy import func, select, update

from gpuaas.contracts import TOPICS
from gpuaas.kit import audit
from gpuaas.kit.auth import Principal
from gpuaas.kit.consumer import run_handlers
from gpuaas.kit.errors import Conflict, NotFound, Unprocessable
from gpuaas.kit.event_signing import SIGNED_TOPICS, SignatureError
from gpuaas.kit.iam import require
from gpuaas.kit.relay import replay
from gpuaas.kit.tables import dead_letters, outbox

router = APIRouter(prefix="/admin", tags=["admin"])
Operator = Annotated[Principal, Depends(require("platform.admin"))]


class DeadLetter(BaseModel):
    id: uuid.UUID
    consumer: str
    event_id: uuid.UUID | None
    event_type: str | None
    topic: str
    partition: int
    offset: int
    error: str
    attempts: int
    status: str
    created_at: datetime
    updated_at: datetime


class DeadLetterPage(BaseModel):
    items: list[DeadLetter]
    total: int


class ReplayRequest(BaseModel):
    since: datetime
    until: datetime | None = None


class ReplayResult(BaseModel):
    requeued: int


class OutboxStatus(BaseModel):
    unsent: int
    oldest_unsent_at: datetime | None
    retained: int
    relay_leader: bool


@router.get("/dead-letters", response_model=DeadLetterPage)
async def list_dead_letters(
    request: Request,
    _: Operator,
    status: str = Query("parked", pattern="^(parked|resolved|all)$"),
    limit: int = Query(100, ge=1, le=500),
    offset: int = Query(0, ge=0),
) -> Any:
    cols = [c for c in dead_letters.c if c.name not in ("payload", "key")]
    where = [] if status == "all" else [dead_letters.c.status == status]
    async with request.app.state.kit.sessions() as session:
        rows = await session.execute(
            select(*cols).where(*where).order_by(dead_letters.c.created_at).limit(limit).offset(offset)
        )
        total = (await session.execute(select(func.count()).select_from(dead_letters).where(*where))).scalar_one()
    return {"items": [dict(r._mapping) for r in rows], "total": total}


@router.post("/dead-letters/{dead_letter_id}/retry", response_model=DeadLetter)
async def retry_dead_letter(request: Request, dead_letter_id: uuid.UUID, principal: Operator) -> Any:
    """Run the handlers again on the parked event; resolve it on success, count the attempt otherwise."""
    kit = request.app.state.kit
    async with kit.sessions() as session, session.begin():
        row = (
            await session.execute(select(dead_letters).where(dead_letters.c.id == dead_letter_id).with_for_update())
        ).first()
        if row is None:
            raise NotFound("dead letter not found", code="dead_letter_not_found")
        if row.status != "parked":
            raise Conflict("this dead letter is already resolved", code="dead_letter_resolved")
        topic = TOPICS.get(row.topic)
        try:
            event = topic.parse(row.payload) if topic else None
        except ValueError as exc:
            raise Unprocessable(f"the stored event cannot be parsed: {exc}", code="dead_letter_malformed") from exc
        if event is not None and row.topic in SIGNED_TOPICS:  # a parked forgery stays parked
            try:
                kit.event_verifier.verify(row.topic, json.loads(row.payload))
            except SignatureError as exc:
                raise Unprocessable(str(exc), code="dead_letter_signature_invalid") from exc
        error: str | None = None
        if event is None:  # a type this version does not know (or a topic it does not read): it stays parked
            error = f"the stored event's type is unknown to this version of {kit.settings.service_name}"
        else:
            try:
                async with session.begin_nested():
                    await run_handlers(session, event, kit.subscriptions.handlers.get(event.type, []))
            except Exception as exc:  # report, keep parked
                error = f"{type(exc).__name__}: {exc}"
        values: dict[str, Any] = {"attempts": row.attempts + 1, "updated_at": func.now()}
        values.update({"error": error[:4000]} if error else {"status": "resolved"})
        await session.execute(update(dead_letters).where(dead_letters.c.id == dead_letter_id).values(**values))
        await audit.record(
            session,
            service=kit.settings.service_name,
            actor=principal,
            action="platform.dead_letter.retry",
            resource_type="dead_letter",
            resource_id=dead_letter_id,
            outcome="failed" if error else "succeeded",
            before={"status": row.status},
            after={"status": "parked" if error else "resolved"},
            reason=error,
        )
        result = (await session.execute(select(dead_letters).where(dead_letters.c.id == dead_letter_id))).one()
    if error:
        raise Conflict(f"the retry failed again: {error}", code="dead_letter_retry_failed")
    return dict(result._mapping)


@router.get("/outbox", response_model=OutboxStatus)
async def outbox_status(request: Request, _: Operator) -> Any:
    kit = request.app.state.kit
    async with kit.sessions() as session:
        unsent, oldest = (
            await session.execute(select(func.count(), func.min(outbox.c.created_at)).where(outbox.c.sent_at.is_(None)))
        ).one()
        retained = (await session.execute(select(func.count()).select_from(outbox))).scalar_one()
    return {
        "unsent": unsent,
        "oldest_unsent_at": oldest,
        "retained": retained,
        "relay_leader": bool(kit.relay and kit.relay.is_leader),
    }


@router.post("/outbox/replay", response_model=ReplayResult)
async def replay_outbox(request: Request, body: ReplayRequest, principal: Operator) -> Any:
    kit = request.app.state.kit
    if body.until is not None and body.until <= body.since:
        raise Unprocessable("`until` must be after `since`", code="invalid_range")
    count = await replay(kit.sessions, body.since, body.until)
    async with kit.sessions() as session, session.begin():
        await audit.record(
            session,
            service=kit.settings.service_name,
            actor=principal,
            action="platform.outbox.replay",
            resource_type="outbox",
            resource_id=kit.settings.schema,
            after={"since": body.since.isoformat(), "until": body.until and body.until.isoformat(), "requeued": count},
        )
    return {"requeued": count}
