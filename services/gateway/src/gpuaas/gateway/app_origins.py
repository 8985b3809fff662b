"""An origin per launchable app: `{instance_id}.<apps domain>` (no I/O; the rules apps.py enforces).

A page an app serves runs with its origin's privileges. On the console's origin it could read the console's
session (refresh token in localStorage) and drive every other app the viewer has a cookie for; the app image
and every member with a shell in the allocation can put script there. On its own origin it reaches only
itself: the browser keeps its storage and cookies apart, and the gateway refuses a request whose `Origin`
is another site (so one app cannot drive another with the viewer's cookie either).

With `GPUAAS_GATEWAY_APPS_DOMAIN` set (and `GPUAAS_GATEWAY_PUBLIC_URL`, the console's URL):
- a browser reaching `/apps/{id}/...` on any other host (the console's Open button, the CLI's URL) is sent
  (307, method and body kept) to the same path on `{id}.<domain>`, with the console's scheme and port;
- an app host serves only its own `/apps/{id}/...`: no console, no API, no other instance;
- a request with a bearer token (CLI, SDK, scripts) is served on any host: it carries no ambient credential
  another page could borrow.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True)
class AppOrigins:
    domain: str  # e.g. "apps.example.com" (each app at "<instance id>.apps.example.com")
    console_url: str  # e.g. "https://gpu.example.com": scheme and port the app origins share

    @classmethod
    def of(cls, domain: str | None, console_url: str | None) -> AppOrigins | None:
        if not domain:
            return None
        if not console_url:
            raise ValueError("GPUAAS_GATEWAY_APPS_DOMAIN needs GPUAAS_GATEWAY_PUBLIC_URL (the console's URL)")
        parts = urlsplit(console_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"GPUAAS_GATEWAY_PUBLIC_URL must be an http(s) URL, got {console_url!r}")
        domain = domain.strip(".").lower()
        if parts.hostname.lower() == domain or parts.hostname.lower().endswith(f".{domain}"):
            raise ValueError("the console must not be on the apps domain (it would share a site with every app)")
        return cls(domain, f"{parts.scheme}://{parts.netloc}")

    def origin_of(self, instance_id: uuid.UUID) -> str:
        parts = urlsplit(self.console_url)
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://{instance_id}.{self.domain}{port}"

    def _app_label(self, host: str | None) -> str | None:
        """The label before the apps domain of a Host header (port dropped); None off the apps domain."""
        name = (host or "").rsplit(":", 1)[0].lower()
        if name == self.domain:
            return ""  # the apps domain itself: an app host that names no app
        return name[: -len(self.domain) - 1] if name.endswith(f".{self.domain}") else None

    def is_app_host(self, host: str | None) -> bool:
        return self._app_label(host) is not None

    def instance_of_host(self, host: str | None) -> uuid.UUID | None:
        label = self._app_label(host)
        try:
            return uuid.UUID(label) if label and "." not in label else None
        except ValueError:
            return None

    def host_serves(self, host: str | None, path: str) -> bool:
        """Whether a request for `path` may be served on `host`: anything on other hosts (the console's,
        where /apps/ redirects), only its own instance's /apps/{id}/... on an app host."""
        if not self.is_app_host(host):
            return True
        instance = self.instance_of_host(host)
        return instance is not None and (path == f"/apps/{instance}" or path.startswith(f"/apps/{instance}/"))

    def same_origin(self, instance_id: uuid.UUID, origin: str | None) -> bool:
        """A request's `Origin` header, when the browser sent one, must be the app's own."""
        return origin is None or origin.rstrip("/").lower() == self.origin_of(instance_id)
