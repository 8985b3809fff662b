"""Enterprise SSO: per-tenant OIDC identity providers owning email domains, account-type discovery,
authorization code + PKCE login against the IdP, and brokered identity linking.

Linking rules (ARCHITECTURE §5): a federated login resolves, in order,
1. an existing link (idp, subject) -> that user;
2. otherwise the IdP must vouch for the email (`email_verified`) and the email's domain must be one
   the IdP's tenant owns; then an existing user with that email is linked only if the user belongs to
   the same tenant (never across tenants, never a personal account); with no such user, one is
   provisioned just in time with the IdP's default role.
A new user is never created when one with the email exists, so no duplicates. Every link is
recorded (table, `federated_identity.linked` event, audit record); refusals are audited too.

A login started with `return_to` ends with a single-use login code in a URL; the code is bound to the
client that started the login by that client's own PKCE S256 challenge (required with `return_to`),
and only its verifier redeems it (a wrong or missing one spends the code).

Network calls to the IdP (discovery, token exchange, JWKS) happen between transactions, never in one.
"""

from __future__ import annotations

import hmac
import re
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import httpx
from authlib.common.security import generate_token
from authlib.oauth2.rfc7636 import create_s256_code_challenge
from joserfc import jwt
from joserfc.errors import JoseError
from joserfc.jwk import KeySet
from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gpuaas.contracts import Actor, new_event_id
from gpuaas.contracts.enums import MembershipScope, Role
from gpuaas.contracts.events import identity as ev
from gpuaas.identity import service
from gpuaas.identity.models import (
    federated_identities,
    identity_providers,
    idp_domains,
    sso_login_codes,
    sso_states,
    tenants,
    users,
)
from gpuaas.identity.settings import Settings
from gpuaas.identity.tokens import Client, new_secret, now, open_session, token_hash
from gpuaas.kit import audit, iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, Forbidden, NotFound, Problem, Unprocessable

SERVICE = "identity"
JIT_ROLES = {Role.project_admin, Role.project_member, Role.viewer}


class IdpError(Problem):
    status, code, title = 502, "idp_error", "Identity provider error"


class InvalidReturnTo(Problem):
    status, code, title = 400, "invalid_return_to", "Invalid return_to"


class CodeChallengeRequired(Problem):
    status, code, title = 400, "code_challenge_required", "PKCE code challenge required"


class InvalidCodeChallenge(Problem):
    status, code, title = 400, "invalid_code_challenge", "Invalid PKCE code challenge"


# RFC 7636: an S256 challenge is the base64url (unpadded) SHA-256 of the verifier, 43 characters; a
# verifier is 43-128 characters of the unreserved set.
S256_CHALLENGE = re.compile(r"[A-Za-z0-9_-]{43}")
CODE_VERIFIER = re.compile(r"[A-Za-z0-9._~-]{43,128}")


def validate_client_challenge(
    return_to: str | None, code_challenge: str | None, code_challenge_method: str | None
) -> str | None:
    """The starting client's PKCE challenge, which binds the login code handed to `return_to` to that
    client: whoever sees the redirect URL (history, logs, a referrer) cannot redeem the code without the
    verifier. Required with `return_to` (the console and the CLI both send one); S256 only; meaningless
    without `return_to` (the callback then answers the tokens itself)."""
    if code_challenge is None and code_challenge_method is None:
        if return_to is not None:
            raise CodeChallengeRequired(
                "a login with return_to needs code_challenge (S256 of a random code_verifier, RFC 7636) "
                "and code_challenge_method=S256"
            )
        return None
    if return_to is None:
        raise InvalidCodeChallenge("code_challenge binds the login code handed to return_to: pass return_to")
    if code_challenge_method != "S256":
        raise InvalidCodeChallenge("code_challenge_method must be S256 (the only method supported)")
    if code_challenge is None or not S256_CHALLENGE.fullmatch(code_challenge):
        raise InvalidCodeChallenge("code_challenge must be the 43-character base64url S256 of the code_verifier")
    return code_challenge


def verifier_matches(code_challenge: str, code_verifier: str | None) -> bool:
    return (
        code_verifier is not None
        and CODE_VERIFIER.fullmatch(code_verifier) is not None
        and hmac.compare_digest(create_s256_code_challenge(code_verifier), code_challenge)
    )


@dataclass(frozen=True)
class Redirect:
    """The callback's answer when the login started with a `return_to`: send the browser there."""

    url: str


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


def validate_return_to(settings: Settings, value: str) -> str:
    """Where a finished SSO login may send the browser (never an open redirect):
    - the platform's own origin (that of `public_url`, or one of `sso_return_origins`), outside `/api/`:
      the console; a path alone (`/...`) means the platform's own origin;
    - the CLI's loopback listener, `http://127.0.0.1:<port>/...` or `http://[::1]:<port>/...` (RFC 8252).
    Anything else (another host, userinfo tricks, backslashes, other schemes, no explicit loopback port)
    is refused with `invalid_return_to`."""
    if not value or len(value) > 2000 or not value.isprintable() or "\\" in value:
        raise InvalidReturnTo("return_to must be a plain URL")
    if value.startswith("/") and not value.startswith("//"):
        value = _origin(settings.public_url) + value
    parts = urlsplit(value)
    try:
        port = parts.port
    except ValueError:
        raise InvalidReturnTo("return_to has an invalid port") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or "@" in parts.netloc:
        raise InvalidReturnTo("return_to must be an http(s) URL without credentials")
    allowed = {_origin(settings.public_url), *(_origin(o) for o in settings.sso_return_origins)}
    if _origin(value) in allowed:
        if parts.path == "/api" or parts.path.startswith("/api/"):
            raise InvalidReturnTo("return_to must be a console page, not an API path")
        return value
    if parts.scheme == "http" and parts.hostname in ("127.0.0.1", "::1") and port is not None:
        return value  # the CLI's loopback redirect
    raise InvalidReturnTo("return_to must be this platform's console or a loopback (127.0.0.1) address")


def _with_query(url: str, params: dict[str, str]) -> str:
    """`url` with `params` set in its query (other parameters and the fragment kept)."""
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k not in params]
    return urlunsplit(parts._replace(query=urlencode([*query, *params.items()])))


def _state(row: Any, domains: list[str]) -> ev.IdentityProviderState:
    return ev.IdentityProviderState(
        idp_id=row["idp_id"],
        tenant_id=row["tenant_id"],
        name=row["name"],
        issuer=row["issuer"],
        domains=sorted(domains),
        default_role=row["default_role"],
        enforce_sso=row["enforce_sso"],
        enabled=row["enabled"],
    )


async def create_idp(
    session: AsyncSession,
    principal: Principal,
    *,
    tenant_id: uuid.UUID,
    name: str,
    issuer: str,
    client_id: str,
    client_secret: str | None,
    domains: list[str],
    default_role: Role | None,
    enforce_sso: bool,
) -> dict[str, Any]:
    await iam.authorize(session, principal, "identity.idp.manage", tenant_id=tenant_id)
    if default_role is not None and default_role not in JIT_ROLES:
        raise Unprocessable(f"{default_role} cannot be a default role for federated users", code="invalid_role")
    domains = sorted({d.lower().strip(".") for d in domains})
    taken = (await session.execute(select(idp_domains.c.domain).where(idp_domains.c.domain.in_(domains)))).all()
    if taken:
        raise Conflict(
            f"domain(s) already owned by an identity provider: {', '.join(r[0] for r in taken)}", code="domain_taken"
        )
    values = {
        "idp_id": new_event_id(),
        "tenant_id": tenant_id,
        "name": name,
        "issuer": issuer.rstrip("/"),
        "client_id": client_id,
        "client_secret": client_secret,
        "default_role": str(default_role) if default_role else None,
        "enforce_sso": enforce_sso,
        "enabled": True,
    }
    await session.execute(insert(identity_providers).values(**values))
    await session.execute(insert(idp_domains), [{"domain": d, "idp_id": values["idp_id"]} for d in domains])
    state = _state(values, domains)
    await service.emit(
        session,
        ev.IdentityProviderCreated.build(
            subject=state.idp_id, data=state, source=SERVICE, tenant_id=tenant_id, actor=principal.actor
        ),
    )
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="identity.idp.create",
        resource_type="identity_provider",
        resource_id=state.idp_id,
        tenant_id=tenant_id,
        after=state.model_dump(mode="json"),
    )
    return state.model_dump()


async def list_idps(session: AsyncSession, principal: Principal, tenant_id: uuid.UUID) -> list[dict[str, Any]]:
    await iam.authorize(session, principal, "identity.idp.manage", tenant_id=tenant_id)
    rows = (await session.execute(select(identity_providers).where(identity_providers.c.tenant_id == tenant_id))).all()
    out = []
    for r in rows:
        domains = (await session.execute(select(idp_domains.c.domain).where(idp_domains.c.idp_id == r.idp_id))).all()
        out.append(_state(dict(r._mapping), [d[0] for d in domains]).model_dump())
    return out


# ----------------------------------------------------------------------------------- discovery


async def _idp_for_domain(session: AsyncSession, domain: str) -> Any:
    return (
        await session.execute(
            select(identity_providers, tenants.c.slug, tenants.c.name.label("tenant_name"))
            .join(idp_domains, idp_domains.c.idp_id == identity_providers.c.idp_id)
            .join(tenants, tenants.c.tenant_id == identity_providers.c.tenant_id)
            .where(idp_domains.c.domain == domain, identity_providers.c.enabled.is_(True))
        )
    ).first()


async def discover(session: AsyncSession, settings: Settings, *, email: str, tenant_hint: str | None) -> dict[str, Any]:
    """Personal vs work account, from the email's domain only. The tenant hint is advisory: it is
    reported back (and whether it matches) but never changes the answer, so it cannot steer a user
    to another tenant's IdP. The answer does not reveal whether an account exists."""
    domain = email.rsplit("@", 1)[1].lower()
    idp = await _idp_for_domain(session, domain)
    hint: dict[str, Any] | None = None
    if tenant_hint:
        hint = {"slug": tenant_hint, "matches": bool(idp is not None and idp.slug == tenant_hint)}
    if idp is None:
        return {
            "email": email,
            "account_type": "personal",
            "login": "password",
            "tenant": None,
            "identity_provider": None,
            "tenant_hint": hint,
        }
    return {
        "email": email,
        "account_type": "work",
        "login": "sso",
        "tenant": {"tenant_id": idp.tenant_id, "slug": idp.slug, "name": idp.tenant_name},
        "identity_provider": {
            "idp_id": idp.idp_id,
            "name": idp.name,
            "enforce_sso": idp.enforce_sso,
            "sso_start_url": f"{settings.public_url}/auth/sso/start?{urlencode({'idp_id': str(idp.idp_id)})}",
        },
        "tenant_hint": hint,
    }


# ------------------------------------------------------------------------------- login (RP side)


class IdpMetadata:
    """The IdP's discovery document and JWKS, cached per issuer for a few minutes."""

    def __init__(self, timeout_s: float, ttl_s: float = 300.0) -> None:
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self._docs: dict[str, tuple[float, dict[str, Any]]] = {}
        self._jwks: dict[str, tuple[float, KeySet]] = {}

    async def document(self, issuer: str) -> dict[str, Any]:
        hit = self._docs.get(issuer)
        if hit and time.monotonic() - hit[0] < self.ttl_s:
            return hit[1]
        doc = await self._get_json(f"{issuer}/.well-known/openid-configuration")
        if doc.get("issuer", "").rstrip("/") != issuer:
            raise IdpError("the identity provider's discovery document names another issuer")
        self._docs[issuer] = (time.monotonic(), doc)
        return doc

    async def keys(self, issuer: str, *, refresh: bool = False) -> KeySet:
        hit = self._jwks.get(issuer)
        if hit and not refresh and time.monotonic() - hit[0] < self.ttl_s:
            return hit[1]
        doc = await self.document(issuer)
        keyset = KeySet.import_key_set(await self._get_json(doc["jwks_uri"]))
        self._jwks[issuer] = (time.monotonic(), keyset)
        return keyset

    async def _get_json(self, url: str) -> dict[str, Any]:
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s) as client:
                resp = await client.get(url)
                resp.raise_for_status()
                return resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise IdpError(
                f"the identity provider is unreachable or answered badly ({exc.__class__.__name__})"
            ) from exc


async def start(
    sessions_: async_sessionmaker[AsyncSession],
    settings: Settings,
    metadata: IdpMetadata,
    *,
    idp_id: uuid.UUID | None,
    email: str | None,
    return_to: str | None = None,
    code_challenge: str | None = None,
    code_challenge_method: str | None = None,
) -> str:
    """Create a single-use state with a PKCE verifier and nonce (and the validated `return_to` with the
    client's own S256 challenge); return the IdP authorization URL."""
    if return_to is not None:
        return_to = validate_return_to(settings, return_to)
    client_challenge = validate_client_challenge(return_to, code_challenge, code_challenge_method)
    async with sessions_() as session:
        if idp_id is not None:
            idp = (
                await session.execute(
                    select(identity_providers).where(
                        identity_providers.c.idp_id == idp_id, identity_providers.c.enabled.is_(True)
                    )
                )
            ).first()
        elif email and "@" in email:
            idp = await _idp_for_domain(session, email.rsplit("@", 1)[1].lower())
        else:
            raise Unprocessable("pass idp_id or a work email", code="idp_required")
    if idp is None:
        raise NotFound("no identity provider for this request", code="idp_not_found")
    doc = await metadata.document(idp.issuer)
    state, verifier, nonce = generate_token(32), generate_token(64), generate_token(24)
    redirect_uri = f"{settings.public_url}/auth/sso/callback"
    async with sessions_() as session, session.begin():
        await session.execute(
            insert(sso_states).values(
                state=state,
                idp_id=idp.idp_id,
                code_verifier=verifier,
                nonce=nonce,
                redirect_uri=redirect_uri,
                expires_at=now() + timedelta(seconds=settings.sso_state_ttl_s),
                return_to=return_to,
                client_code_challenge=client_challenge,
            )
        )
    query = {
        "response_type": "code",
        "client_id": idp.client_id,
        "redirect_uri": redirect_uri,
        "scope": "openid email profile",
        "state": state,
        "nonce": nonce,
        "code_challenge": create_s256_code_challenge(verifier),
        "code_challenge_method": "S256",
    }
    if email:
        query["login_hint"] = email
    return f"{doc['authorization_endpoint']}?{urlencode(query)}"


async def callback(
    sessions_: async_sessionmaker[AsyncSession],
    settings: Settings,
    metadata: IdpMetadata,
    *,
    state: str,
    code: str | None,
    error: str | None,
    client: Client,
) -> dict[str, Any] | Redirect:
    """Finish the login. Without a `return_to` the answer is the token pair (JSON). With one, the
    browser is sent back there with `login_code` (single use, short-lived; exchanged at
    `POST /auth/token`, grant_type=sso_login_code), or with `error` (a stable code) and
    `error_description` when the sign-in failed."""
    return_to: str | None = None
    try:
        async with sessions_() as session, session.begin():
            row, fresh = await _consume_state(session, state)
        return_to = row.return_to
        if not fresh:
            raise _StateInvalid("the sign-in request was already used or has expired; start again")
        if error or not code:
            raise Problem(
                f"the identity provider refused the sign-in: {error or 'no code'}", code="idp_denied", status=401
            )
        user, method = await _sign_in(sessions_, settings, metadata, row, code)
        if return_to is None:
            async with sessions_() as session, session.begin():
                outcome = await open_session(
                    session, settings, user=user, method="sso", client=client, idp_id=row.idp_id
                )
            return {**outcome, "link_method": method}
        login_code = new_secret("slc")
        async with sessions_() as session, session.begin():
            await session.execute(
                insert(sso_login_codes).values(
                    code_hash=token_hash(login_code),
                    user_id=user.user_id,
                    idp_id=row.idp_id,
                    link_method=method,
                    return_to=return_to,
                    code_challenge=row.client_code_challenge,
                    expires_at=now() + timedelta(seconds=settings.sso_login_code_ttl_s),
                )
            )
        return Redirect(_with_query(return_to, {"login_code": login_code}))
    except Problem as exc:
        if return_to is None:
            raise
        return Redirect(_with_query(return_to, {"error": exc.code, "error_description": exc.detail}))


class _StateInvalid(Problem):
    status, code, title = 400, "sso_state_invalid", "Invalid sign-in state"


async def _consume_state(session: AsyncSession, state: str) -> tuple[Any, bool]:
    """Lock and spend the state row (single use): (row, whether it was fresh). A known but spent or
    expired state with a return_to still tells where to send the browser back (validated at start)."""
    row = (
        await session.execute(
            select(
                sso_states.c.used_at,
                sso_states.c.expires_at,
                sso_states.c.code_verifier,
                sso_states.c.nonce,
                sso_states.c.redirect_uri,
                sso_states.c.return_to,
                sso_states.c.client_code_challenge,
                identity_providers.c.idp_id,
                identity_providers.c.tenant_id,
                identity_providers.c.issuer,
                identity_providers.c.client_id,
                identity_providers.c.client_secret,
                identity_providers.c.default_role,
            )
            .join(identity_providers, identity_providers.c.idp_id == sso_states.c.idp_id)
            .where(sso_states.c.state == state)
            .with_for_update(of=sso_states)
        )
    ).first()
    spent = row is not None and (row.used_at is not None or row.expires_at <= now())
    if row is None or (spent and row.return_to is None):
        raise _StateInvalid("the sign-in request is unknown, used or expired; start again")
    if spent:
        return row, False
    await session.execute(update(sso_states).where(sso_states.c.state == state).values(used_at=func.now()))
    return row, True


async def _sign_in(
    sessions_: async_sessionmaker[AsyncSession], settings: Settings, metadata: IdpMetadata, row: Any, code: str
) -> tuple[Any, str]:
    """Exchange the IdP's code (outside any transaction), verify the ID token, then link or provision
    the user (a refusal is audited and committed before it is raised)."""
    doc = await metadata.document(row.issuer)
    form = {
        "grant_type": "authorization_code",
        "code": code,
        "redirect_uri": row.redirect_uri,
        "code_verifier": row.code_verifier,
        "client_id": row.client_id,
    }
    if row.client_secret:
        form["client_secret"] = row.client_secret
    try:
        async with httpx.AsyncClient(timeout=settings.idp_timeout_s) as http:
            resp = await http.post(doc["token_endpoint"], data=form)
    except httpx.HTTPError as exc:
        raise IdpError(f"the identity provider's token endpoint failed ({exc.__class__.__name__})") from exc
    if resp.status_code != 200 or "id_token" not in resp.text:
        raise IdpError(f"the identity provider did not issue an ID token (HTTP {resp.status_code})")
    claims = await _verify_id_token(
        metadata, resp.json()["id_token"], issuer=row.issuer, client_id=row.client_id, nonce=row.nonce
    )
    refusal: Problem | None = None
    async with sessions_() as session, session.begin():
        try:
            return await _link(session, row, claims)
        except Problem as exc:  # refusals are audited: commit the record, then answer
            refusal = exc
            await audit.record(
                session,
                service=SERVICE,
                actor=Actor.system("identity-sso"),
                action="identity.federation.link",
                resource_type="identity_provider",
                resource_id=row.idp_id,
                tenant_id=row.tenant_id,
                outcome="denied",
                after={"subject": claims.get("sub"), "email": claims.get("email")},
                reason=exc.code,
            )
    assert refusal is not None
    raise refusal


async def exchange_login_code(
    sessions_: async_sessionmaker[AsyncSession],
    settings: Settings,
    *,
    code: str,
    code_verifier: str | None,
    client: Client,
) -> dict[str, Any]:
    """`grant_type=sso_login_code`: the code a finished SSO login handed to return_to becomes a session,
    exactly once (a second presentation, or an expired code, is `invalid_grant`). A code carries the
    starting client's S256 challenge: a missing or wrong `code_verifier` is `invalid_grant` too, and the
    code is spent all the same (committed before the refusal), so a code seen in a URL cannot be tried
    again, not even with the right verifier afterwards."""
    async with sessions_() as session, session.begin():
        row = (
            await session.execute(
                select(sso_login_codes).where(sso_login_codes.c.code_hash == token_hash(code)).with_for_update()
            )
        ).first()
        if row is None or row.used_at is not None or row.expires_at <= now():
            raise Problem("the login code is unknown, used or expired; sign in again", code="invalid_grant")
        await session.execute(
            update(sso_login_codes).where(sso_login_codes.c.code_hash == row.code_hash).values(used_at=func.now())
        )
        user = (await session.execute(select(users).where(users.c.user_id == row.user_id))).one()
        refused = row.code_challenge is not None and not verifier_matches(row.code_challenge, code_verifier)
        if refused:  # someone else's redemption (the code leaked from a URL) or a broken client: recorded
            await audit.record(
                session,
                service=SERVICE,
                actor=Actor.system("identity-sso"),
                action="identity.session.create",
                resource_type="user",
                resource_id=user.user_id,
                tenant_id=user.tenant_id,
                outcome="denied",
                reason="code_verifier_mismatch" if code_verifier else "code_verifier_missing",
                after={"method": "sso", "source": client.ip, "idp_id": str(row.idp_id)},
            )
        else:
            if user.status != "active":
                raise Forbidden("this account is disabled", code="account_disabled")
            outcome = await open_session(session, settings, user=user, method="sso", client=client, idp_id=row.idp_id)
    if refused:  # raised only now: the code's spending (and the audit record) above are committed
        raise Problem(
            "the code_verifier is missing or does not match the code_challenge this sign-in started with; "
            "the login code is spent: sign in again",
            code="invalid_grant",
        )
    return {**outcome, "link_method": row.link_method}


async def _verify_id_token(
    metadata: IdpMetadata, token: str, *, issuer: str, client_id: str, nonce: str
) -> dict[str, Any]:
    registry = jwt.JWTClaimsRegistry(
        iss={"essential": True, "value": issuer},
        aud={"essential": True, "value": client_id},
        exp={"essential": True},
        sub={"essential": True},
        nonce={"essential": True, "value": nonce},
    )
    for refresh in (False, True):  # an unknown kid: the IdP rotated its keys, fetch them once more
        try:
            decoded = jwt.decode(token, await metadata.keys(issuer, refresh=refresh), algorithms=["ES256", "RS256"])
            registry.validate(decoded.claims)
            return decoded.claims
        except (JoseError, ValueError) as exc:
            if refresh:
                raise IdpError(f"the ID token is not valid ({exc.__class__.__name__})") from exc
    raise AssertionError("unreachable")


async def _link(session: AsyncSession, idp: Any, claims: dict[str, Any]) -> tuple[Any, str]:
    subject = str(claims["sub"])
    linked = (
        await session.execute(
            select(users)
            .join(federated_identities, federated_identities.c.user_id == users.c.user_id)
            .where(federated_identities.c.idp_id == idp.idp_id, federated_identities.c.subject == subject)
        )
    ).first()
    if linked is not None:
        if linked.status != "active":
            raise Forbidden("this account is disabled", code="account_disabled")
        return linked, "existing_link"

    email = str(claims.get("email") or "")
    if not email or "@" not in email:
        raise Forbidden("the identity provider sent no email", code="email_missing")
    if claims.get("email_verified") is not True:
        raise Forbidden("the identity provider has not verified this email", code="email_not_verified")
    domain = email.rsplit("@", 1)[1].lower()
    owner = (await session.execute(select(idp_domains.c.idp_id).where(idp_domains.c.domain == domain))).scalar()
    if owner != idp.idp_id:
        raise Forbidden(f"the domain {domain} is not owned by this identity provider", code="email_domain_not_owned")

    existing = (
        await session.execute(select(users).where(func.lower(users.c.email) == email.lower()).with_for_update())
    ).first()
    actor = Actor.system("identity-sso")
    if existing is not None:
        if existing.tenant_id != idp.tenant_id:
            raise Forbidden(
                "an account with this email exists outside this organisation; it is not linked automatically",
                code="account_link_refused",
            )
        if existing.status != "active":
            raise Forbidden("this account is disabled", code="account_disabled")
        user, method = existing, "verified_email"
        await session.execute(update(users).where(users.c.user_id == user.user_id).values(email_verified=True))
    else:
        user_id = await service.insert_user(
            session,
            None,
            email=email,
            password=None,
            display_name=str(claims.get("name") or ""),
            tenant_id=idp.tenant_id,
            email_verified=True,
            actor=actor,
        )
        if idp.default_role:
            await service.grant(
                session,
                None,
                user_id=user_id,
                scope=MembershipScope.tenant,
                role=Role(idp.default_role),
                tenant_id=idp.tenant_id,
                actor=actor,
            )
        user = (await session.execute(select(users).where(users.c.user_id == user_id))).one()
        method = "jit"

    await session.execute(
        insert(federated_identities).values(
            idp_id=idp.idp_id, subject=subject, user_id=user.user_id, email=email, link_method=method
        )
    )
    state = ev.FederatedIdentityState(
        user_id=user.user_id,
        tenant_id=idp.tenant_id,
        idp_id=idp.idp_id,
        subject=subject,
        email=email,
        link_method=method,
    )
    await service.emit(
        session,
        ev.FederatedIdentityLinked.build(
            subject=user.user_id, data=state, source=SERVICE, tenant_id=idp.tenant_id, actor=actor
        ),
    )
    await audit.record(
        session,
        service=SERVICE,
        actor=actor,
        action="identity.federation.link",
        resource_type="user",
        resource_id=user.user_id,
        tenant_id=idp.tenant_id,
        after=state.model_dump(mode="json"),
    )
    return user, method
