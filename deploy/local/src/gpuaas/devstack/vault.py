"""`GPUAAS_VAULT=openbao make run`: the services take their keys from a local OpenBao instead of the environment.

A raft-backed OpenBao under `<root>/openbao` (kept across runs; initialised once, its root token and unseal key
in `<root>/openbao/init.json`, mode 600, like secrets.json; unsealed at every start) set up as an operator would
(docs/operations.md, "Keys in Vault or OpenBao"): KV v2 `gpuaas-kv`, Transit `gpuaas-transit` with a derived key
per service that keeps secrets at rest, AppRole with each service's committed policy (deploy/vault/policies).
Each service's keyring entry (the stack's own `secrets.json` keyring, so switching between the two sources keeps
every sealed row readable) is wrapped by its Transit key into `gpuaas-kv/<service>/secrets-keys`, its signing key
written to `gpuaas-kv/<service>/event-signing`; the service gets only its role_id and secret_id.
"""

# hvac ships no type information.
# pyright: reportMissingTypeStubs=false, reportUnknownMemberType=false, reportUnknownVariableType=false
# pyright: reportUnknownArgumentType=false
from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import hvac
import hvac.exceptions

from gpuaas.devstack.credentials import Credentials
from gpuaas.devstack.infra import OpenBao, free_port
from gpuaas.kit.testing_vault import POLICY_DIR

KV, TRANSIT, APPROLE = "gpuaas-kv", "gpuaas-transit", "approle"
WITH_KEYRING = ("identity", "allocations", "app-runtime")


class LocalVault:
    def __init__(self, root: Path, credentials: Credentials, services: list[str], host: str = "127.0.0.1") -> None:
        self.dir = root / "openbao"
        self.credentials = credentials
        self.services = [s.replace("_", "-") for s in services]
        self.server = OpenBao(self.dir, port=free_port(host), host=host, dev=False)
        self.roles: dict[str, tuple[str, str]] = {}

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> None:
        init = self.dir / "init.json"
        self.server.start()
        if init.exists():
            saved = json.loads(init.read_text())
            self.server.root_token, self.server.unseal_key = saved["root_token"], saved["key"]
            self.server.unseal()
        else:
            self.server.init()
            init.chmod(0o600)
        self._configure(hvac.Client(url=self.url, token=self.server.root_token, timeout=10))

    def _configure(self, root: Any) -> None:
        mounts = root.sys.list_mounted_secrets_engines()["data"]
        if f"{KV}/" not in mounts:
            root.sys.enable_secrets_engine("kv", path=KV, options={"version": "2"})
            root.sys.enable_secrets_engine("transit", path=TRANSIT)
        if f"{APPROLE}/" not in root.sys.list_auth_methods()["data"]:
            root.sys.enable_auth_method("approle", path=APPROLE)
        keyring = [e.strip() for e in self.credentials.secrets_keys.split(",") if e.strip()]
        for service in self.services:
            policy = f"gpuaas-{service}"
            root.sys.create_or_update_policy(name=policy, policy=(POLICY_DIR / f"{service}.hcl").read_text())
            root.auth.approle.create_or_update_approle(
                policy, token_policies=[policy], token_ttl="1h", token_max_ttl="24h", mount_point=APPROLE
            )
            role_id = root.auth.approle.read_role_id(policy, mount_point=APPROLE)["data"]["role_id"]
            secret_id = root.auth.approle.generate_secret_id(policy, mount_point=APPROLE)["data"]["secret_id"]
            self.roles[service] = (role_id, secret_id)
            name = service.replace("-", "_")
            seed = self.credentials.event_signing_key(name)
            root.secrets.kv.v2.create_or_update_secret(
                path=f"{service}/event-signing", secret={"seed": seed}, mount_point=KV
            )
            if service not in WITH_KEYRING:
                continue
            try:
                root.secrets.transit.read_key(name=service, mount_point=TRANSIT)
            except hvac.exceptions.InvalidPath:
                root.secrets.transit.create_key(name=service, derived=True, mount_point=TRANSIT)
            wrapped = []
            for entry in keyring:
                kid, _, key = entry.partition(":")
                answer = root.secrets.transit.encrypt_data(
                    name=service,
                    plaintext=key,
                    context=base64.b64encode(f"{service}:{kid}".encode()).decode(),
                    mount_point=TRANSIT,
                )
                wrapped.append(f"{kid}:{answer['data']['ciphertext']}")
            root.secrets.kv.v2.create_or_update_secret(
                path=f"{service}/secrets-keys", secret={"keys": ",".join(wrapped)}, mount_point=KV
            )

    def env(self, name: str) -> dict[str, str]:
        """What a service gets instead of GPUAAS_SECRETS_KEYS and its signing key: its own AppRole login."""
        prefix = f"GPUAAS_{name.upper()}_"
        role_id, secret_id = self.roles[name.replace("_", "-")]
        return {
            "GPUAAS_SECRETS_KEY_SOURCE": "vault",
            f"{prefix}VAULT_URL": self.url,
            f"{prefix}VAULT_AUTH": "approle",
            f"{prefix}VAULT_ROLE_ID": role_id,
            f"{prefix}VAULT_SECRET_ID": secret_id,
            f"{prefix}VAULT_KV_MOUNT": KV,
            f"{prefix}VAULT_TRANSIT_MOUNT": TRANSIT,
        }

    def stop(self) -> None:
        self.server.stop()
