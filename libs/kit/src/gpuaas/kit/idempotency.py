"""`Idempotency-Key` for POST: a retried request gets the first response, never a second effect.

The key is reserved (row with no status) before the request runs, so a concurrent duplicate gets
409 instead of running twice; a different body under the same key gets 422; a 5xx releases the key
so the client may retry. Keys are scoped to the verified caller and kept at least 24 hours.

A reservation whose request never finished (the process was killed mid-request, so neither a
response nor a 5xx release was recorded) is taken over by a retry once it is older than
`RESERVATION_TIMEOUT`; until then the retry gets 409 `idempotency_request_in_progress`. Unless its
effect had committed: every transaction that writes during the request also sets the key's
`committed_at`, in that same transaction (`install` hooks the service's sessions). A retry of such a
request is never run again; it gets 409 `idempotency_request_committed` (the effect is there, only the
response was lost: read the resource at the request's path, named in the problem).

A reservation younger than `RESERVATION_TIMEOUT` belongs to a request still in flight, committed or not
(its effect commits before its response is stored): a concurrent duplicate gets 409
`idempotency_request_in_progress` with `Retry-After`, and its retry then gets the stored response.

A secret shown once (a node token, a service account's client secret, tokens: `SECRET_FIELDS`) is never
stored: the stored response has it redacted, and a replay answers with the resource, the secret's value
null, plus `secret_not_shown_again` (the redacted fields' dotted paths) in the body and the
`Secret-Not-Shown-Again` header (issue 28). A secret-holding response that is not a JSON object (or says
`Cache-Control: no-store` with nothing to redact) is not kept at all: 409 `idempotency_response_not_kept`.

Keys are for authenticated callers: a key on a call with no bearer token is refused (400
`idempotency_key_needs_credentials`) — anonymous callers (logins, agents with their node tokens) cannot be
told apart here, and one shared scope would let one read another's stored response or burn its key; a bearer
token that does not verify runs the request without a key (the route answers its 401, the client refreshes
and retries).
"""

from __future__ import annotations

import hashlib
import json
import random
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol, cast

from sqlalchemy import Row, delete, event, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpuaas.kit.auth import TokenVerifier
from gpuaas.kit.db import ServiceSession
from gpuaas.kit.errors import Problem, problem_response
from gpuaas.kit.http import header
from gpuaas.kit.tables import idempotency_keys


class _Verifying(Protocol):
    """What the middleware needs of the kit runtime (named here: kit.app imports this module)."""

    @property
    def verifier(self) -> TokenVerifier: ...


@dataclass
class _Captured:
    """The response the route sent, as stored for a replay (500 until the route says otherwise)."""

    status: int = 500
    headers: list[tuple[bytes, bytes]] = field(default_factory=lambda: list[tuple[bytes, bytes]]())
    body: bytes = b""


MAX_KEY_LENGTH = 255
TTL = timedelta(hours=24)
PRUNE_PROBABILITY = 0.01
# Longer than any request runs: an older reservation with no response belongs to a dead process.
RESERVATION_TIMEOUT = timedelta(seconds=60)

# (principal, key) of the idempotent request the current task is running, if any.
_scope: ContextVar[tuple[str, str] | None] = ContextVar("idempotency_scope", default=None)


def install(sync_sessions: type[Session] | sessionmaker[Any]) -> None:
    """Hook a service's sessions so that a transaction which writes while an idempotent request runs
    marks the key committed in that same transaction (the marker commits exactly when the effect does)."""

    # (Not after_begin: an AsyncSession begins its connection inside the first execute, after do_orm_execute.)
    @event.listens_for(sync_sessions, "after_commit")
    @event.listens_for(sync_sessions, "after_rollback")
    def _reset(session: Session) -> None:
        session.info["idempotent_wrote"] = False

    @event.listens_for(sync_sessions, "do_orm_execute")
    def _note_write(state: Any) -> None:
        if _writes(state):
            state.session.info["idempotent_wrote"] = True

    @event.listens_for(sync_sessions, "before_commit")
    def _mark(session: Session) -> None:
        scope = _scope.get()
        if scope is None or not session.info.get("idempotent_wrote"):
            return
        session.execute(
            update(idempotency_keys)
            .where(
                idempotency_keys.c.principal == scope[0],
                idempotency_keys.c.key == scope[1],
                idempotency_keys.c.committed_at.is_(None),
            )
            .values(committed_at=func.now())
        )


install(ServiceSession)


def _writes(state: Any) -> bool:
    if state.is_insert or state.is_update or state.is_delete:
        return True
    if state.is_select:
        return False
    # text() statements: anything but a read counts as a write
    return not str(state.statement).lstrip().upper().startswith(("SELECT", "SHOW", "SET ", "EXPLAIN"))


class IdempotencyMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = header(scope, b"idempotency-key") if scope["type"] == "http" else None
        if key is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        if not key or len(key) > MAX_KEY_LENGTH:
            await problem_response(
                400,
                "invalid_idempotency_key",
                "Invalid Idempotency-Key",
                f"Idempotency-Key must be 1-{MAX_KEY_LENGTH} characters.",
            )(scope, receive, send)
            return
        kit = scope["app"].state.kit
        principal = await _caller(kit, scope)
        if principal is None:
            await problem_response(
                400,
                "idempotency_key_needs_credentials",
                "Idempotency-Key needs credentials",
                "Idempotency-Key is accepted only with a bearer token: anonymous calls have no scope of their own.",
            )(scope, receive, send)
            return
        if principal == UNVERIFIED:  # the route answers (401); nothing to reserve a key for
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        digest = hashlib.sha256(scope["method"].encode() + scope["path"].encode() + b"\0" + body).hexdigest()

        async with kit.sessions() as session, session.begin():
            if random.random() < PRUNE_PROBABILITY:  # amortised clean-up, no extra loop to run
                await session.execute(delete(idempotency_keys).where(idempotency_keys.c.created_at < func.now() - TTL))
            reserved = await session.execute(
                pg_insert(idempotency_keys)
                .values(principal=principal, key=key, method=scope["method"], path=scope["path"], request_hash=digest)
                .on_conflict_do_nothing()
                .returning(idempotency_keys.c.key)
            )
            first = reserved.first() is not None
            if not first:  # a reservation left by a process that died mid-request: take it over
                taken = await session.execute(
                    update(idempotency_keys)
                    .where(
                        idempotency_keys.c.principal == principal,
                        idempotency_keys.c.key == key,
                        idempotency_keys.c.request_hash == digest,
                        idempotency_keys.c.status_code.is_(None),
                        idempotency_keys.c.committed_at.is_(None),
                        idempotency_keys.c.created_at < func.now() - RESERVATION_TIMEOUT,
                    )
                    .values(created_at=func.now())
                    .returning(idempotency_keys.c.key)
                )
                first = taken.first() is not None
            existing = None
            if not first:
                # `live`: reserved (or taken over) recently enough that the request may still be running
                live = (idempotency_keys.c.created_at >= func.now() - RESERVATION_TIMEOUT).label("live")
                existing = (
                    await session.execute(
                        select(idempotency_keys, live).where(
                            idempotency_keys.c.principal == principal, idempotency_keys.c.key == key
                        )
                    )
                ).first()
        if not first and existing is not None:
            if existing.request_hash != digest:
                resp = problem_response(
                    422,
                    "idempotency_key_reused",
                    "Idempotency-Key reused",
                    "This Idempotency-Key was used with a different request.",
                )
            elif existing.status_code is None and (existing.live or existing.committed_at is None):
                # Still running (its effect may have committed already; its response is not stored yet).
                resp = problem_response(
                    409,
                    "idempotency_request_in_progress",
                    "Request in progress",
                    "A request with this Idempotency-Key is still being processed; retry after the "
                    "Retry-After seconds to get its response.",
                )
                resp.headers["Retry-After"] = "1"
            elif existing.status_code is None:
                resp = problem_response(
                    409,
                    "idempotency_request_committed",
                    "Request already applied",
                    "The request with this Idempotency-Key was applied, but its response was lost when the "
                    "service stopped. Read the resource's current state instead of sending it again.",
                    method=existing.method,
                    path=existing.path,
                )
            elif _stored_headers(existing).get(NOT_KEPT):
                resp = _not_kept(existing)
            else:
                await _replay(existing, send)
                return
            await resp(scope, receive, send)
            return

        captured = _Captured()

        async def replay_receive() -> Message:
            return {"type": "http.request", "body": body, "more_body": False}

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                captured.status = int(message["status"])
                captured.headers = list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                captured.body += message.get("body", b"")
            await send(message)

        token = _scope.set((principal, key))
        try:
            await self.app(scope, replay_receive, capture)
        finally:
            _scope.reset(token)
            status = captured.status
            async with kit.sessions() as session, session.begin():
                where = (idempotency_keys.c.principal == principal, idempotency_keys.c.key == key)
                if status >= 500:
                    await session.execute(delete(idempotency_keys).where(*where))
                else:
                    headers = {
                        k.decode(): v.decode()
                        for k, v in captured.headers
                        if k.lower() in (b"content-type", b"location", b"etag")
                    }
                    kept: bytes | None = captured.body
                    if holds_secret(captured.headers, kept or b""):
                        redacted = redact_secrets(kept or b"")
                        if redacted is None:  # nothing to show again without the secret: not kept at all
                            kept, headers = None, {**headers, NOT_KEPT: "secret"}
                        else:
                            kept, paths = redacted
                            headers = {**headers, SECRET_NOT_SHOWN: ", ".join(paths)}
                    await session.execute(
                        update(idempotency_keys)
                        .where(*where)
                        .values(status_code=status, response_body=kept, response_headers=headers)
                    )


# --- responses that carry secrets are never kept (issue 17) ---

NOT_KEPT = "x-gpuaas-response-not-kept"  # in the stored headers of a response whose body was not stored
# Field names whose values are secrets: a response holding one at any depth is not stored for replay.
SECRET_NOT_SHOWN = "secret-not-shown-again"  # stored (and replayed) header: the redacted fields, comma-separated
REDACTED_FIELD = "secret_not_shown_again"  # the replayed body's list of the redacted fields' dotted paths
SECRET_FIELDS = frozenset(
    {
        "client_secret",
        "secret",
        "password",
        "access_token",
        "refresh_token",
        "id_token",
        "private_key",
        "token",
        "node_token",
    }
)


def holds_secret(headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
    """A response that says `Cache-Control: no-store`, or whose JSON holds a secret-named field with a value."""
    for k, v in headers:
        if k.lower() == b"cache-control" and b"no-store" in v.lower():
            return True
    if not body.lstrip().startswith((b"{", b"[")):
        return False
    try:
        doc = json.loads(body)
    except ValueError:
        return False
    return _secret_in(doc)


def _secret_in(doc: Any) -> bool:
    if isinstance(doc, dict):
        fields = cast(dict[str, Any], doc)
        return any((k in SECRET_FIELDS and v) or _secret_in(v) for k, v in fields.items())
    if isinstance(doc, list):
        return any(_secret_in(v) for v in cast(list[Any], doc))
    return False


def _stored_headers(row: Row[Any]) -> dict[str, str]:
    """The kept response headers of an idempotency row (a JSON column: none while the request runs)."""
    return cast(dict[str, str], row.response_headers or {})


def _not_kept(row: Row[Any]) -> Any:
    return problem_response(
        409,
        "idempotency_response_not_kept",
        "Response not kept",
        "The request with this Idempotency-Key was applied; its response held a secret, which is never stored "
        "for replay. Read the resource (or rotate the secret) instead of sending the request again.",
        method=row.method,
        path=row.path,
        location=_stored_headers(row).get("location"),
    )


def redact_secrets(body: bytes) -> tuple[bytes, list[str]] | None:
    """The JSON object `body` with every secret-named field's value set to null and `secret_not_shown_again`
    listing their dotted paths; None when there is nothing to redact (not a JSON object, no such field)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    paths: list[str] = []
    redacted = _redact(cast(dict[str, Any], doc), "", paths)
    if not paths:
        return None
    return json.dumps({**redacted, REDACTED_FIELD: paths}).encode(), paths


def _redact(doc: Any, at: str, paths: list[str]) -> Any:
    if isinstance(doc, dict):
        out: dict[str, Any] = {}
        for k, v in cast(dict[str, Any], doc).items():
            here = f"{at}.{k}" if at else k
            if k in SECRET_FIELDS and v:
                out[k] = None
                paths.append(here)
            else:
                out[k] = _redact(v, here, paths)
        return out
    if isinstance(doc, list):
        return [_redact(v, f"{at}[{i}]", paths) for i, v in enumerate(cast(list[Any], doc))]
    return doc


UNVERIFIED = "\0unverified"  # a bearer token that does not verify (never a principal's subject)


async def _caller(kit: _Verifying, scope: Scope) -> str | None:
    """The verified caller's subject; None without a bearer token; UNVERIFIED for one that does not verify."""
    auth = header(scope, b"authorization") or ""
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    try:
        principal = await kit.verifier.verify(token.strip())
    except Problem:
        return UNVERIFIED  # the route itself answers 401
    return str(principal.subject)


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _replay(row: Row[Any], send: Send) -> None:
    headers = [(k.encode(), v.encode()) for k, v in _stored_headers(row).items()]
    headers.append((b"idempotent-replayed", b"true"))
    body: bytes = row.response_body or b""
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": row.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})
