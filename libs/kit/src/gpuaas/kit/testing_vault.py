"""Test helpers for a real Vault / OpenBao (the root conftest's `openbao` server, `vault` sandbox per test).

A `VaultSandbox` gives one test its own KV v2 mount, Transit mount and AppRole auth mount (random names),
created with the server's root token and removed afterwards, so tests never see each other's data. The
committed per-service policies (deploy/vault/policies/*.hcl) name the deployment's mounts (`gpuaas-kv`,
`gpuaas-transit`); `policy_text` renames those to the sandbox's.
"""

# hvac ships no type information.
# pyright: reportMissingTypeStubs=false, reportUnknownMemberType=false, reportUnknownVariableType=false
# pyright: reportUnknownArgumentType=false
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hvac

from gpuaas.kit.vault import VaultConfig

POLICY_DIR = Path(__file__).resolve().parents[5] / "deploy" / "vault" / "policies"


@dataclass
class VaultSandbox:
    url: str
    root_token: str
    kv: str = ""
    transit: str = ""
    auth_mount: str = ""
    root: Any = field(default=None, repr=False)

    @classmethod
    def create(cls, url: str, root_token: str) -> VaultSandbox:
        suffix = uuid.uuid4().hex[:8]
        box = cls(url, root_token, kv=f"kv-{suffix}", transit=f"transit-{suffix}", auth_mount=f"approle-{suffix}")
        box.root = hvac.Client(url=url, token=root_token, timeout=5)
        box.root.sys.enable_secrets_engine("kv", path=box.kv, options={"version": "2"})
        box.root.sys.enable_secrets_engine("transit", path=box.transit)
        box.root.sys.enable_auth_method("approle", path=box.auth_mount)
        return box

    def close(self) -> None:
        for mount in (self.kv, self.transit):
            self.root.sys.disable_secrets_engine(mount)
        self.root.sys.disable_auth_method(self.auth_mount)

    def token_config(self) -> VaultConfig:
        return VaultConfig(url=self.url, auth="token", token=self.root_token)

    def transit_key(self, name: str) -> None:
        """A derived AES-256-GCM key (every wrap bound to its context), allowing its versions to be retired."""
        self.root.secrets.transit.create_key(name=name, derived=True, mount_point=self.transit)

    def rotate(self, name: str) -> int:
        self.root.secrets.transit.rotate_key(name=name, mount_point=self.transit)
        return int(self.root.secrets.transit.read_key(name=name, mount_point=self.transit)["data"]["latest_version"])

    def put(self, path: str, **values: str) -> None:
        self.root.secrets.kv.v2.create_or_update_secret(path=path, secret=values, mount_point=self.kv)

    def policy_text(self, hcl: str) -> str:
        return hcl.replace("gpuaas-kv/", f"{self.kv}/").replace("gpuaas-transit/", f"{self.transit}/")

    def approle(self, role: str, policy_hcl: str, *, token_ttl: str = "60s", token_max_ttl: str = "1h") -> VaultConfig:
        """An AppRole login (role_id + a fresh secret_id) whose tokens carry only `policy_hcl`."""
        policy = f"{role}-{self.auth_mount}"
        self.root.sys.create_or_update_policy(name=policy, policy=self.policy_text(policy_hcl))
        self.root.auth.approle.create_or_update_approle(
            role,
            token_policies=[policy],
            token_ttl=token_ttl,
            token_max_ttl=token_max_ttl,
            mount_point=self.auth_mount,
        )
        role_id = self.root.auth.approle.read_role_id(role, mount_point=self.auth_mount)["data"]["role_id"]
        secret_id = self.root.auth.approle.generate_secret_id(role, mount_point=self.auth_mount)["data"]["secret_id"]
        return VaultConfig(
            url=self.url, auth="approle", role_id=role_id, secret_id=secret_id, approle_mount=self.auth_mount
        )

    def service_policy(self, service: str) -> str:
        """The committed policy of a service (deploy/vault/policies/<service>.hcl)."""
        return (POLICY_DIR / f"{service}.hcl").read_text()
