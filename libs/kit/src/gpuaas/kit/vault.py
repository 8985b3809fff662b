"""A Vault / OpenBao client for the services (hvac underneath): one login, a token kept alive, and every
failure turned into one client-visible problem.

- Authentication: `approle` (role_id + secret_id, the production choice: a token with a TTL that the client
  renews before it expires and replaces by a fresh login when it cannot be renewed or was revoked) or
  `token` (a static token, renewed while renewable; for development).
- Renewal happens before each call, when less than `renew_fraction` of the token's TTL is left; a token
  that is no longer renewable, reached its max TTL, expired while the server was away, or was revoked
  (403) is replaced by a new AppRole login and the call is tried once more.
- Sealed, unreachable, or refused: `SecretsUnavailable` (HTTP 503, code `secrets_unavailable`, problem+json
  through the kit's handlers). Nothing in the message carries a secret. When the server is back (unsealed,
  restarted), the next call works: no state is kept that a restart of the server invalidates except the
  token, which is replaced.
- Transit (`TransitKey`): wraps and unwraps data keys under a named key; the ciphertext names its key
  version (`vault:v3:...`), `rewrap` moves a ciphertext to the latest version without exposing the data key.
- KV v2 (`read_kv`): values the services fetch at start (the event-signing key, see `gpuaas.kit.vault_keys`).

hvac is synchronous: the async helpers run it in a worker thread. Never call them inside a database
transaction (a network call would hold the transaction open).
"""

# hvac ships no type information.
# pyright: reportMissingTypeStubs=false, reportUnknownMemberType=false, reportUnknownVariableType=false
# pyright: reportUnknownArgumentType=false, reportUnknownLambdaType=false
from __future__ import annotations

import asyncio
import base64
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import hvac
import hvac.exceptions
import requests

from gpuaas.kit.logging import get_logger
from gpuaas.kit.problems import Unavailable

log = get_logger(__name__)
T = TypeVar("T")
CODE = "secrets_unavailable"


class SecretsUnavailable(Unavailable):
    """The secrets server cannot answer (sealed, unreachable, or this service's credentials are refused)."""

    status, code, title = 503, CODE, "Secrets server unavailable"


@dataclass(frozen=True)
class VaultConfig:
    url: str
    auth: Literal["token", "approle"] = "approle"
    token: str = ""
    role_id: str = ""
    secret_id: str = ""
    approle_mount: str = "approle"
    # PEM bundle the server's certificate is checked against; empty: the system CAs.
    ca_cert: str = ""
    timeout_s: int = 5
    # Renew when less than this fraction of the token's TTL is left.
    renew_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.auth == "approle" and not (self.role_id and self.secret_id):
            raise ValueError("vault auth `approle` needs a role_id and a secret_id")
        if self.auth == "token" and not self.token:
            raise ValueError("vault auth `token` needs a token")


class VaultClient:
    """Thread-safe: hvac calls run in worker threads; the token is replaced under a lock."""

    def __init__(self, config: VaultConfig) -> None:
        self.config = config
        self._client = hvac.Client(url=config.url, verify=config.ca_cert or True, timeout=config.timeout_s)
        self._lock = threading.Lock()
        self._token_ttl = 0.0  # 0: a token that does not expire (or not looked up yet)
        self._expires_at = 0.0
        self._renewable = False
        self._have_token = False
        # Counters the tests (and logs) read: how often the client logged in and renewed.
        self.logins = 0
        self.renewals = 0

    # --- the token ---------------------------------------------------------------------------------------

    def _set_lease(self, ttl: float, renewable: bool) -> None:
        self._token_ttl, self._renewable = ttl, renewable
        self._expires_at = time.monotonic() + ttl if ttl > 0 else 0.0

    def _login(self) -> None:
        if self.config.auth == "approle":
            answer = self._client.auth.approle.login(
                role_id=self.config.role_id, secret_id=self.config.secret_id, mount_point=self.config.approle_mount
            )
            auth = answer["auth"]
            self._client.token = auth["client_token"]
            self._set_lease(float(auth["lease_duration"]), bool(auth["renewable"]))
            self.logins += 1
            log.info("vault_login", ttl_s=self._token_ttl, renewable=self._renewable)
        else:
            self._client.token = self.config.token
            data = self._client.auth.token.lookup_self()["data"]
            self._set_lease(float(data.get("ttl") or 0), bool(data.get("renewable")))
        self._have_token = True

    def _renew(self) -> None:
        auth = self._client.auth.token.renew_self()["auth"]
        ttl = float(auth["lease_duration"])
        self._expires_at = time.monotonic() + ttl
        # A token near its max TTL comes back with less than asked: the next due check logs in instead.
        self._renewable = bool(auth["renewable"]) and ttl > self._token_ttl * self.config.renew_fraction
        self.renewals += 1

    def _ensure_token(self) -> None:
        with self._lock:
            if not self._have_token:
                self._login()
                return
            if self._expires_at == 0.0:
                return
            left = self._expires_at - time.monotonic()
            if left > self._token_ttl * self.config.renew_fraction:
                return
            if left > 0 and self._renewable:
                try:
                    self._renew()
                    return
                except hvac.exceptions.Forbidden:
                    pass  # revoked or past its max TTL: a new login below
            if self.config.auth != "approle":
                return  # a static token cannot be replaced: the call will say whether it still works
            self._login()

    def _relogin_after_refusal(self) -> bool:
        if self.config.auth != "approle":
            return False
        with self._lock:
            self._have_token = False
        return True

    # --- calls -------------------------------------------------------------------------------------------

    def call(self, what: str, fn: Callable[[hvac.Client], T]) -> T:
        """Run `fn(client)` with a live token; every failure becomes SecretsUnavailable naming `what`."""
        for attempt in (1, 2):
            try:
                self._ensure_token()
                return fn(self._client)
            except hvac.exceptions.Forbidden:
                if attempt == 1 and self._relogin_after_refusal():
                    continue  # the token was revoked or expired: log in once more
                raise SecretsUnavailable(f"{what}: the secrets server refused this service's credentials") from None
            except hvac.exceptions.VaultDown:
                self._forget_token_on_restart()
                raise SecretsUnavailable(f"{what}: the secrets server is sealed") from None
            except (requests.ConnectionError, requests.Timeout):
                self._forget_token_on_restart()
                raise SecretsUnavailable(f"{what}: the secrets server is unreachable") from None
            except hvac.exceptions.InvalidPath:
                raise SecretsUnavailable(f"{what}: not found on the secrets server") from None
            except hvac.exceptions.VaultError as exc:
                if attempt == 1 and self._token_ran_out() and self._relogin_after_refusal():
                    continue  # the token reached its (max) TTL during the call (OpenBao may answer 500): log in again
                raise SecretsUnavailable(f"{what}: the secrets server answered {type(exc).__name__}") from None
        raise AssertionError("unreachable")

    def _token_ran_out(self) -> bool:
        with self._lock:
            return bool(self._expires_at) and time.monotonic() >= self._expires_at - 1.0

    def _forget_token_on_restart(self) -> None:
        """After an outage the token may have expired meanwhile: check it again (renew or log in) next call."""
        with self._lock:
            if self._expires_at and time.monotonic() >= self._expires_at:
                self._have_token = False

    async def acall(self, what: str, fn: Callable[[hvac.Client], T]) -> T:
        return await asyncio.to_thread(self.call, what, fn)

    def read_kv(self, mount: str, path: str) -> dict[str, Any]:
        answer = self.call(
            f"read {mount}/{path}",
            lambda c: c.secrets.kv.v2.read_secret_version(path=path, mount_point=mount, raise_on_deleted_version=True),
        )
        return dict(answer["data"]["data"])

    def kv_version(self, mount: str, path: str) -> int:
        answer = self.call(
            f"read {mount}/{path} metadata",
            lambda c: c.secrets.kv.v2.read_secret_metadata(path=path, mount_point=mount),
        )
        return int(answer["data"]["current_version"])


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def ciphertext_version(ciphertext: str) -> int:
    """The Transit key version a ciphertext was made with (`vault:v3:...` → 3)."""
    prefix, _, rest = ciphertext.partition(":")
    version = rest.partition(":")[0]
    if prefix != "vault" or not version.startswith("v") or not version[1:].isdigit():
        raise ValueError("not a Transit ciphertext")
    return int(version[1:])


@dataclass(frozen=True)
class TransitKey:
    """One Transit key (created `derived=true`: every wrap is bound to its `context`, e.g. the row's id, so
    a wrapped key copied to another row does not unwrap)."""

    vault: VaultClient
    mount: str
    name: str

    def wrap(self, data_key: bytes, context: bytes) -> str:
        answer = self.vault.call(
            f"transit encrypt ({self.name})",
            lambda c: c.secrets.transit.encrypt_data(
                name=self.name, plaintext=_b64(data_key), context=_b64(context), mount_point=self.mount
            ),
        )
        return str(answer["data"]["ciphertext"])

    def unwrap(self, wrapped: str, context: bytes) -> bytes:
        answer = self.vault.call(
            f"transit decrypt ({self.name})",
            lambda c: c.secrets.transit.decrypt_data(
                name=self.name, ciphertext=wrapped, context=_b64(context), mount_point=self.mount
            ),
        )
        return base64.b64decode(answer["data"]["plaintext"])

    def rewrap(self, wrapped: str, context: bytes) -> str:
        answer = self.vault.call(
            f"transit rewrap ({self.name})",
            lambda c: c.secrets.transit.rewrap_data(
                name=self.name, ciphertext=wrapped, context=_b64(context), mount_point=self.mount
            ),
        )
        return str(answer["data"]["ciphertext"])

    def latest_version(self) -> int:
        answer = self.vault.call(
            f"transit key ({self.name})",
            lambda c: c.secrets.transit.read_key(name=self.name, mount_point=self.mount),
        )
        return int(answer["data"]["latest_version"])

    async def awrap(self, data_key: bytes, context: bytes) -> str:
        return await asyncio.to_thread(self.wrap, data_key, context)

    async def aunwrap(self, wrapped: str, context: bytes) -> bytes:
        return await asyncio.to_thread(self.unwrap, wrapped, context)

    async def arewrap(self, wrapped: str, context: bytes) -> str:
        return await asyncio.to_thread(self.rewrap, wrapped, context)
