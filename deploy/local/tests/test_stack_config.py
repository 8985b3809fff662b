"""Fast checks of the Stack's configuration: ports, environment, secrets, external servers. No processes."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from pydantic import EmailStr, TypeAdapter, ValidationError

from gpuaas.devstack.config import DEFAULT_PORTS, SERVICES, StackConfig, StackError
from gpuaas.devstack.stack import Stack


def test_defaults_are_the_documented_ports(tmp_path: Path) -> None:
    s = Stack(StackConfig(root=tmp_path))
    assert s.ports == DEFAULT_PORTS
    assert s.gateway_url == "http://127.0.0.1:8000"
    assert s.service_url("app_runtime") == "http://127.0.0.1:8004"
    assert s.kafka_bootstrap == "127.0.0.1:9092"
    assert s.names == [*SERVICES, "gateway"]
    assert not s.external_database and not s.external_broker


def test_free_ports_are_distinct_and_overridable(tmp_path: Path) -> None:
    s = Stack(StackConfig(root=tmp_path, free_ports=True, ports={"gateway": 18_000}))
    assert s.ports["gateway"] == 18_000
    assert len(set(s.ports.values())) == len(DEFAULT_PORTS)
    assert s.kafka_bootstrap == f"127.0.0.1:{s.ports['kafka']}"


def test_env_for_wires_each_service(tmp_path: Path) -> None:
    s = Stack(StackConfig(root=tmp_path, free_ports=True, env={"*": {"GPUAAS_X": "1"}, "billing": {"GPUAAS_Y": "2"}}))
    env = s.env_for("identity")
    url = urlsplit(env["GPUAAS_IDENTITY_DATABASE_URL"])
    assert url.scheme == "postgresql+asyncpg"
    assert url.username == "gpuaas_identity"
    assert url.path == "/gpuaas"
    assert url.port == s.ports["postgres"]
    assert env["GPUAAS_IDENTITY_PORT"] == str(s.ports["identity"])
    assert env["GPUAAS_IDENTITY_HOST"] == "127.0.0.1"
    assert env["GPUAAS_IDENTITY_LOG_JSON"] == "true"
    assert env["GPUAAS_KAFKA_BOOTSTRAP"] == s.kafka_bootstrap
    assert env["GPUAAS_JWKS_URL"] == f"http://127.0.0.1:{s.ports['identity']}/.well-known/jwks.json"
    assert env["GPUAAS_JWT_ISSUER"] == f"{s.gateway_url}/api/identity"
    assert env["GPUAAS_IDENTITY_PUBLIC_URL"] == f"{s.gateway_url}/api/identity"
    # identity believes the gateway's X-Forwarded-For (same host): logins count per client (issue 28)
    assert json.loads(env["GPUAAS_IDENTITY_TRUSTED_PROXIES"]) == ["127.0.0.1", "::1"]
    assert (env["GPUAAS_IDENTITY_BOOTSTRAP_ADMIN_EMAIL"], env["GPUAAS_IDENTITY_BOOTSTRAP_ADMIN_PASSWORD"]) == (
        s.admin_login
    )
    assert env["GPUAAS_X"] == "1" and "GPUAAS_Y" not in env

    app_env = s.env_for("app_runtime")
    assert urlsplit(app_env["GPUAAS_APP_RUNTIME_DATABASE_URL"]).username == "gpuaas_app_runtime"
    assert "GPUAAS_IDENTITY_BOOTSTRAP_ADMIN_EMAIL" not in app_env
    assert s.env_for("billing")["GPUAAS_Y"] == "2"

    gw = s.env_for("gateway")
    assert json.loads(gw["GPUAAS_GATEWAY_UPSTREAMS"]) == {n: s.service_url(n) for n in SERVICES}
    assert not any(k.endswith("DATABASE_URL") for k in gw)


def test_process_env_keeps_the_superuser_url_from_services(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUAAS_DATABASE_URL", "postgresql://postgres:secret@db.example:5432/postgres")
    s = Stack(root=tmp_path)
    assert s.external_database
    env = s._process_env("catalog")
    assert "GPUAAS_DATABASE_URL" not in env
    assert "secret" not in json.dumps(env)


def test_secrets_are_generated_once_and_private(tmp_path: Path) -> None:
    a = Stack(StackConfig(root=tmp_path))
    first = (a.admin_login, a.service_password("billing"), a.database_url("billing"))
    b = Stack(StackConfig(root=tmp_path))
    assert (b.admin_login, b.service_password("billing"), b.database_url("billing")) == first
    assert a.service_password("billing") != a.service_password("catalog")
    assert stat.S_IMODE((tmp_path / "secrets.json").stat().st_mode) == 0o600
    assert a.admin_login[0] == "admin@gpuaas.example"


def test_the_seeded_operator_passes_the_email_validation_of_login_discovery(tmp_path: Path) -> None:
    """`gpuaas login` and the console discover the account type first (identity's `GET /auth/discover`, whose
    `email` is an `EmailStr`): a seeded address on a special-use domain (`.local`, `.test`) is refused there."""
    email = Stack(StackConfig(root=tmp_path)).admin_login[0]
    assert TypeAdapter(EmailStr).validate_python(email) == email
    with pytest.raises(ValidationError, match="special-use or reserved name"):
        TypeAdapter(EmailStr).validate_python("admin@gpuaas.local")


def test_external_servers_from_env(tmp_path: Path) -> None:
    env = {
        "GPUAAS_DATABASE_URL": "postgresql://postgres:pw@db.example:5432/postgres",
        "GPUAAS_KAFKA_BOOTSTRAP": "kafka.example:9093",
    }
    s = Stack(StackConfig.from_env(env, root=tmp_path))
    t = Stack(StackConfig.from_env(env, root=tmp_path / "other"))
    assert s.pg is None and s.tansu is None
    assert s.kafka_bootstrap == "kafka.example:9093"
    assert s.env_for("metering")["GPUAAS_KAFKA_BOOTSTRAP"] == "kafka.example:9093"
    assert s.database_admin_url == "postgresql://postgres:pw@db.example:5432/gpuaas"
    assert urlsplit(s.database_url("metering")).hostname == "db.example"
    # Roles are global to a server: every stack on the same server must agree on their passwords.
    assert s.service_password("metering") == t.service_password("metering")
    with pytest.raises(StackError, match="external"):
        s.restart_broker()
    with pytest.raises(StackError, match="external"):
        s.restart_postgres()


def test_unknown_service_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(StackError, match="unknown services"):
        Stack(StackConfig(root=tmp_path, services=["identity", "payments"]))
    with pytest.raises(StackError, match="unknown broker"):
        Stack(StackConfig(root=tmp_path, broker="redpanda"))


def test_process_control_needs_a_started_stack(tmp_path: Path) -> None:
    s = Stack(StackConfig(root=tmp_path, free_ports=True))
    for call in (lambda: s.start_service("billing"), s.restart_broker, s.restart_postgres):
        with pytest.raises(StackError, match="not started"):
            call()
    assert s.supervise_once() == []
    s.stop()  # a no-op, not an error
    assert not (tmp_path / "stack.json").exists()


def test_the_stack_generates_its_own_keys_and_hands_each_service_its_own(tmp_path: Path) -> None:
    """Issue 17: no default keys in the services; the stack generates a secrets-at-rest keyring and an envelope
    signing key per service into secrets.json (kept across runs) and gives every service identity's public key."""
    from gpuaas.kit.event_signing import EventSigner, EventVerifier
    from gpuaas.kit.secrets_at_rest import Keyring

    s = Stack(StackConfig(root=tmp_path))
    identity, billing = s.env_for("identity"), s.env_for("billing")
    assert Keyring.parse(identity["GPUAAS_SECRETS_KEYS"]).primary == "local1"
    assert identity["GPUAAS_IDENTITY_EVENT_SIGNING_KEY"] != billing["GPUAAS_BILLING_EVENT_SIGNING_KEY"]
    verifier = EventVerifier.parse(billing["GPUAAS_EVENT_VERIFY_KEYS"])
    assert EventSigner(identity["GPUAAS_IDENTITY_EVENT_SIGNING_KEY"]).kid in verifier.keys["identity"]
    assert set(verifier.keys) == {"identity", "allocations", "catalog", "app-runtime", "metering", "billing"}
    again = Stack(StackConfig(root=tmp_path)).env_for("identity")
    assert again["GPUAAS_SECRETS_KEYS"] == identity["GPUAAS_SECRETS_KEYS"]
    assert "GPUAAS_SECRETS_KEYS" not in s.env_for("gateway")


def test_each_running_stack_gets_its_own_overlay_pool_and_keeps_it_across_restarts(tmp_path: Path) -> None:
    """Two stacks' agents share this kernel: the same project subnet or VNI in both would refuse the second's
    bridge. Each claims a slot (its /16 and VNIs) while it runs; a restart takes its remembered slot back."""
    import ipaddress

    first, second = (Stack(StackConfig(root=tmp_path / n, free_ports=True)) for n in ("a", "b"))
    a, b = first.env_for("allocations"), second.env_for("allocations")
    pools = {ipaddress.IPv4Network(e["GPUAAS_ALLOCATIONS_OVERLAY_POOL"]) for e in (a, b)}
    assert len(pools) == 2 and not next(iter(pools)).overlaps(sorted(pools)[1])
    assert all(p.subnet_of(ipaddress.IPv4Network("10.208.0.0/12")) for p in pools)
    vni = sorted(int(e["GPUAAS_ALLOCATIONS_OVERLAY_VNI_BASE"]) for e in (a, b))
    assert vni[1] - vni[0] >= 256  # a /16 holds 256 segments: the VNI ranges do not overlap either
    assert "GPUAAS_ALLOCATIONS_OVERLAY_POOL" not in first.env_for("billing")
    first.stop()  # releases the slot
    restarted = Stack(StackConfig(root=tmp_path / "a", free_ports=True))
    again = restarted.env_for("allocations")
    overlay = ("GPUAAS_ALLOCATIONS_OVERLAY_POOL", "GPUAAS_ALLOCATIONS_OVERLAY_VNI_BASE")
    assert [again[k] for k in overlay] == [a[k] for k in overlay]  # remembered: its segments keep their subnets
    restarted.stop()
    second.stop()


def test_a_slot_whose_subnets_are_in_use_is_skipped_unless_it_is_the_stacks_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stack killed without its stop leaves its agents' project networks (containers on them) holding its
    slot's first subnets: a new stack skips that slot; a restart of the stack that owns it takes it back."""
    import ipaddress

    from gpuaas.devstack import overlay_slots

    probe = overlay_slots.OverlaySlot(tmp_path / "probe")
    slot = probe.claim()  # a slot no stack on this machine holds now
    probe.release()
    leftover = next(overlay_slots.slot_network(slot).subnets(new_prefix=24))
    monkeypatch.setattr(overlay_slots, "subnets_in_use", lambda: [leftover])
    owner = overlay_slots.OverlaySlot(tmp_path / "owner")
    (tmp_path / "owner").mkdir()
    (tmp_path / "owner" / "overlay-slot").write_text(str(slot))
    fresh = overlay_slots.OverlaySlot(tmp_path / "fresh")
    try:
        got = ipaddress.IPv4Network(fresh.env()["GPUAAS_ALLOCATIONS_OVERLAY_POOL"])
        assert fresh.slot != slot and not got.overlaps(leftover)
        fresh.release()
        assert owner.claim() == slot  # its own segments are what holds the subnet
    finally:
        owner.release()
        fresh.release()
