"""A real Keycloak on loopback: the enterprise identity provider of the federation e2e test.

The server distribution (`org.keycloak:keycloak-quarkus-dist`, a zip) comes from Maven Central once
(`mvn dependency:copy`) and is unpacked into `~/.cache/gpuaas/keycloak/<version>/` (or
`GPUAAS_KEYCLOAK_CACHE`); it runs in development mode (`start-dev`: embedded H2, plain http) on a
free loopback port, with Java 21+ (`JAVA_HOME=/usr/lib/jvm/temurin-25-jdk-amd64` here, or
`GPUAAS_KEYCLOAK_JAVA_HOME`), its data in a directory of the caller's. Each `Keycloak` is its own
server: the test creates its realm, client and users through the admin REST API (`KeycloakAdmin`).

    kc = Keycloak(Path(".local/keycloak"))
    kc.start()              # fetch + unpack (first time), start, wait until the master realm answers
    admin = KeycloakAdmin(kc.url, kc.admin_user, kc.admin_password)
    kc.stop()

`python -m gpuaas.devstack.keycloak fetch` only fetches (what `make keycloak` runs).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from gpuaas.devstack.infra import free_port, stop_process

KEYCLOAK_VERSION = "26.5.6"
ARTIFACT = "org.keycloak:keycloak-quarkus-dist:{version}:zip"
DEFAULT_JAVA_HOME = "/usr/lib/jvm/temurin-25-jdk-amd64"


class KeycloakError(RuntimeError):
    """Keycloak could not be fetched or started; the message says why."""


def cache_dir(version: str = KEYCLOAK_VERSION) -> Path:
    base = os.environ.get("GPUAAS_KEYCLOAK_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "gpuaas" / "keycloak") / version


def java_home() -> str:
    """A Java 21+ home: GPUAAS_KEYCLOAK_JAVA_HOME, else the Temurin 25 JDK of this machine kind."""
    home = os.environ.get("GPUAAS_KEYCLOAK_JAVA_HOME", DEFAULT_JAVA_HOME)
    if not (Path(home) / "bin" / "java").exists():
        raise KeycloakError(f"Keycloak needs Java 21+: none at {home} (set GPUAAS_KEYCLOAK_JAVA_HOME)")
    return home


def ensure_distribution(version: str = KEYCLOAK_VERSION) -> Path:
    """The unpacked server (the directory holding bin/kc.sh); fetched and unpacked once, then cached."""
    target = cache_dir(version)
    home = target / f"keycloak-{version}"
    if (target / ".complete").exists():
        return home
    mvn = shutil.which("mvn")
    if not mvn:
        raise KeycloakError("fetching Keycloak needs Maven: install maven (make install does)")
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cmd = [
        mvn,
        "-q",
        "-B",
        "dependency:copy",
        f"-Dartifact={ARTIFACT.format(version=version)}",
        f"-DoutputDirectory={tmp}",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    archives = list(tmp.glob("keycloak-quarkus-dist-*.zip"))
    if result.returncode != 0 or not archives:
        shutil.rmtree(tmp, ignore_errors=True)
        raise KeycloakError(f"mvn dependency:copy failed ({result.returncode}):\n{result.stdout}{result.stderr}")
    with zipfile.ZipFile(archives[0]) as z:
        z.extractall(tmp)
    archives[0].unlink()
    for script in (tmp / f"keycloak-{version}" / "bin").glob("*.sh"):
        script.chmod(0o755)  # zipfile drops the mode bits
    (tmp / ".complete").write_text(version + "\n")
    try:
        os.replace(tmp, target)  # atomic; a concurrent fetch that won leaves ours behind
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / ".complete").exists():
            raise
    return home


@dataclass
class Keycloak:
    """One Keycloak server in development mode on 127.0.0.1:<port>, its data under `data_dir`."""

    data_dir: Path
    port: int = 0
    version: str = KEYCLOAK_VERSION
    admin_user: str = "admin"
    admin_password: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    heap: str = "768m"
    startup_timeout_s: float = 600.0  # the first start builds (Quarkus augmentation): minutes on a busy machine
    proc: subprocess.Popen[bytes] | None = None
    startup_s: float | None = None
    _log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "keycloak.log"

    def start(self) -> Keycloak:
        home = ensure_distribution(self.version)
        self.port = self.port or free_port()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "JAVA_HOME": java_home(),
            "KC_BOOTSTRAP_ADMIN_USERNAME": self.admin_user,
            "KC_BOOTSTRAP_ADMIN_PASSWORD": self.admin_password,
            "JAVA_OPTS_KC_HEAP": f"-Xms256m -Xmx{self.heap}",
            # Quarkus' thread-local reset needs this on Java 24+ (else an error per worker thread).
            "JAVA_OPTS_APPEND": "--add-opens=java.base/java.lang=ALL-UNNAMED",
        }
        cmd = [
            str(home / "bin" / "kc.sh"),
            "start-dev",
            "--http-host=127.0.0.1",
            f"--http-port={self.port}",
            f"--http-management-port={free_port()}",
            "--db=dev-mem",  # each server starts empty; nothing is written into the cached distribution's data/
        ]
        t0 = time.monotonic()
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.data_dir
        )
        deadline = t0 + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise KeycloakError(f"Keycloak exited ({self.proc.returncode}):\n{self._tail()}")
            try:
                if httpx.get(f"{self.url}/realms/master", timeout=2).status_code == 200:
                    self.startup_s = time.monotonic() - t0
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise KeycloakError(f"Keycloak did not answer within {self.startup_timeout_s:.0f} s:\n{self._tail()}")

    def _tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None


class KeycloakAdmin:
    """Keycloak's admin REST API (a token of the master realm's admin through `admin-cli`). Creating a
    realm takes Keycloak seconds on an idle machine and over a minute on a loaded one: long timeouts."""

    def __init__(self, url: str, user: str, password: str, timeout_s: float = 300.0) -> None:
        self.url = url
        r = httpx.post(
            f"{url}/realms/master/protocol/openid-connect/token",
            data={"grant_type": "password", "client_id": "admin-cli", "username": user, "password": password},
            timeout=timeout_s,
        )
        r.raise_for_status()
        self.http = httpx.Client(
            base_url=f"{url}/admin", headers={"Authorization": f"Bearer {r.json()['access_token']}"}, timeout=timeout_s
        )

    def _ok(self, r: httpx.Response) -> httpx.Response:
        if r.status_code >= 300:
            raise KeycloakError(f"{r.request.method} {r.request.url}: {r.status_code} {r.text[:500]}")
        return r

    def create_realm(self, realm: str, **settings: Any) -> None:
        self._ok(self.http.post("/realms", json={"realm": realm, "enabled": True, **settings}))

    def create_client(self, realm: str, client_id: str, redirect_uris: list[str], **settings: Any) -> str:
        """A confidential OIDC client (authorization code, PKCE S256 required); returns its secret."""
        body = {
            "clientId": client_id,
            "protocol": "openid-connect",
            "enabled": True,
            "publicClient": False,
            "standardFlowEnabled": True,
            "directAccessGrantsEnabled": False,
            "redirectUris": redirect_uris,
            "attributes": {"pkce.code.challenge.method": "S256", "post.logout.redirect.uris": "+"},
            **settings,
        }
        self._ok(self.http.post(f"/realms/{realm}/clients", json=body))
        internal = self._ok(self.http.get(f"/realms/{realm}/clients", params={"clientId": client_id})).json()[0]["id"]
        return str(self._ok(self.http.get(f"/realms/{realm}/clients/{internal}/client-secret")).json()["value"])

    def create_user(self, realm: str, username: str, email: str, password: str, *, email_verified: bool) -> str:
        body = {
            "username": username,
            "email": email,
            "emailVerified": email_verified,
            "enabled": True,
            "firstName": username.capitalize(),
            "lastName": "Test",
            "credentials": [{"type": "password", "value": password, "temporary": False}],
        }
        r = self._ok(self.http.post(f"/realms/{realm}/users", json=body))
        return r.headers["location"].rsplit("/", 1)[-1]

    def set_enabled(self, realm: str, user_id: str, enabled: bool) -> None:
        self._ok(self.http.put(f"/realms/{realm}/users/{user_id}", json={"enabled": enabled}))

    def sessions(self, realm: str, user_id: str) -> list[dict[str, Any]]:
        return list(self._ok(self.http.get(f"/realms/{realm}/users/{user_id}/sessions")).json())

    def logout_user(self, realm: str, user_id: str) -> None:
        self._ok(self.http.post(f"/realms/{realm}/users/{user_id}/logout"))

    def close(self) -> None:
        self.http.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuaas.devstack.keycloak")
    parser.add_argument("command", choices=["fetch"])
    parser.add_argument("--version", default=KEYCLOAK_VERSION)
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    home = ensure_distribution(args.version)
    print(f"keycloak {args.version} at {home} ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
