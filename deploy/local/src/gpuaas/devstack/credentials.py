"""The stack's passwords and tokens: `<root>/secrets.json`, generated once (mode 600) and kept across
runs, so that a restarted stack finds its database roles, seeded operator and agents' node tokens."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from pathlib import Path
from typing import Any

from gpuaas.contracts import Event
from gpuaas.devstack.config import SERVICES
from gpuaas.devstack.state import read_json, write_private
from gpuaas.kit.event_signing import EventSigner, generate_seed, public_of
from gpuaas.kit.secrets_at_rest import generate_key_text


class Credentials:
    def __init__(self, path: Path, admin_email: str, database_url: str | None = None) -> None:
        self.path = path
        self.admin_email = admin_email
        # An external server's superuser URL: the services' passwords are derived from it (see below).
        self.database_url = database_url
        self._data: dict[str, Any] | None = None

    def _store(self) -> dict[str, Any]:
        if self._data is not None:
            return self._data
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = read_json(self.path)
        changed = not data
        if not data.get("postgres_password"):
            data["postgres_password"] = secrets.token_urlsafe(18)
            changed = True
        services = data.setdefault("services", {})
        for svc in SERVICES:
            if not services.get(svc):
                services[svc] = secrets.token_urlsafe(18)
                changed = True
        # Secrets at rest and envelope signing (issue 17): the services have no default keys; these are this
        # stack's own, generated once and kept (the sealed rows and signed topics outlive a restart).
        if not data.get("secrets_keys"):
            data["secrets_keys"] = generate_key_text("local1")
            changed = True
        if not data.get("workload_token_key"):  # launchable apps' per-instance secrets (allocations + gateway)
            data["workload_token_key"] = secrets.token_urlsafe(32)
            changed = True
        signing = data.setdefault("event_signing_keys", {})
        for svc in SERVICES:
            if not signing.get(svc):
                signing[svc] = generate_seed()
                changed = True
        admin = data.setdefault("admin", {})
        if not admin.get("password"):
            admin["password"] = secrets.token_urlsafe(12)
            changed = True
        if admin.get("email") != self.admin_email:
            admin["email"] = self.admin_email
            changed = True
        if changed:
            write_private(self.path, data)
        self._data = data
        return data

    @property
    def postgres_password(self) -> str:
        return str(self._store()["postgres_password"])

    @property
    def admin_login(self) -> tuple[str, str]:
        """The seeded platform operator (identity bootstraps it at first start)."""
        admin = self._store()["admin"]
        return admin["email"], admin["password"]

    def service_password(self, service: str) -> str:
        if self.database_url:
            # Roles are global to a server, and several stacks (test sessions, CI jobs) may share an
            # external one: derive the password from the server's superuser URL so they all agree.
            key = self.database_url.encode()
            return hmac.new(key, f"gpuaas-devstack:{service}".encode(), hashlib.sha256).hexdigest()[:32]
        return str(self._store()["services"][service])

    @property
    def secrets_keys(self) -> str:
        """The keyring every service seals its secrets at rest with (GPUAAS_SECRETS_KEYS)."""
        return str(self._store()["secrets_keys"])

    @property
    def workload_token_key(self) -> str:
        """GPUAAS_WORKLOAD_TOKEN_KEY of allocations and the gateway (gpuaas.kit.workload_tokens)."""
        return str(self._store()["workload_token_key"])

    def event_signing_key(self, service: str) -> str:
        """`service`'s envelope signing key; by its spec name (app_runtime) or its events' source (app-runtime)."""
        return str(self._store()["event_signing_keys"][service.replace("-", "_")])

    def signed_payload(self, event: Event) -> bytes:
        """The event as its source's relay publishes it: signed with that service's key (unsigned ones are parked)."""
        return EventSigner(self.event_signing_key(event.source)).sign_payload(event.model_dump_json().encode())

    @property
    def event_verify_keys(self) -> str:
        """Every service's public envelope key (GPUAAS_EVENT_VERIFY_KEYS), under its topic owner name."""
        keys = self._store()["event_signing_keys"]
        return ",".join(f"{svc.replace('_', '-')}:{public_of(seed)}" for svc, seed in sorted(keys.items()))

    def agent_token(self, name: str) -> str | None:
        """The node token kept for local agent `name`, if any."""
        token = self._store().get("agents", {}).get(name)
        return str(token) if token else None

    def set_agent_token(self, name: str, token: str) -> None:
        store = self._store()
        store.setdefault("agents", {})[name] = token
        write_private(self.path, store)
