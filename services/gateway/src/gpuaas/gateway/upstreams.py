"""The services behind the gateway: each upstream's name, base URL and public path segment, and
which of their paths are public (no token needed). Shared by the edge checks and the OpenAPI merge."""

from __future__ import annotations

from dataclasses import dataclass

PUBLIC_IDENTITY_PREFIXES = frozenset({"auth", "oauth", ".well-known", "oidc"})
HEALTH_LEAVES = frozenset({"healthz", "readyz"})


@dataclass(frozen=True)
class Upstream:
    name: str  # settings key, e.g. "app_runtime"
    base_url: str  # no trailing slash

    @property
    def segment(self) -> str:
        """The public path segment: /api/<segment>/..."""
        return self.name.replace("_", "-")

    @property
    def ws_base_url(self) -> str:
        return "ws" + self.base_url.removeprefix("http")


def upstream_table(upstreams: dict[str, str]) -> dict[str, Upstream]:
    """Upstreams keyed by public path segment."""
    table = [Upstream(name, url) for name, url in upstreams.items()]
    return {u.segment: u for u in table}


def segments(path: str) -> list[str]:
    return [p for p in path.split("/") if p]


def is_public(upstream: Upstream, rest: str) -> bool:
    """Health probes of every service, and identity's sign-in paths, need no token."""
    parts = segments(rest)
    if parts and parts[-1] in HEALTH_LEAVES:
        return True
    return upstream.name == "identity" and bool(parts) and parts[0] in PUBLIC_IDENTITY_PREFIXES
