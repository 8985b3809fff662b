"""Unit tests of the secrets-at-rest keyring (gpuaas.kit.secrets_at_rest) and the envelope signatures
(gpuaas.kit.event_signing): no default key, bound associated data, rotation, canonical bytes. The keyring
tests run with both key sources: the environment and (integration) a real OpenBao's Transit."""

from __future__ import annotations

import base64
import json
import os

import pytest

from gpuaas.contracts.events import identity as ev
from gpuaas.contracts.registry import IDENTITY
from gpuaas.kit.event_signing import EventSigner, EventVerifier, SignatureError, generate_seed, public_of
from gpuaas.kit.idempotency import holds_secret
from gpuaas.kit.secrets_at_rest import Keyring, SecretsKeyError, generate_key_text, is_sealed
from gpuaas.kit.testing_events import platform_admin
from gpuaas.kit.vault import SecretsUnavailable, TransitKey, VaultClient, ciphertext_version
from gpuaas.kit.vault_keys import rewrap_keyring, unwrap_keyring, wrap_new_key, wrapped_entries


def test_missing_malformed_and_published_keys_are_refused() -> None:
    with pytest.raises(SecretsKeyError, match="GPUAAS_SECRETS_KEYS is not set"):
        Keyring.parse("")
    with pytest.raises(SecretsKeyError, match="kid:base64key"):
        Keyring.parse(base64.b64encode(os.urandom(32)).decode())
    with pytest.raises(SecretsKeyError, match="32 bytes"):
        Keyring.parse("k:" + base64.b64encode(os.urandom(16)).decode())
    with pytest.raises(SecretsKeyError, match="published development key"):
        Keyring.parse("k:ZGV2LW9ubHkta2VrLWRvLW5vdC11c2UtaW4tcHJvZCE=")


class KeySource:
    """Where a keyring's data keys come from: the environment (`kid:base64key`) or Vault (`kid:vault:vN:...`,
    each data key wrapped by the service's Transit key and unwrapped at start; gpuaas.kit.vault_keys)."""

    def __init__(self, transit: TransitKey | None = None) -> None:
        self.transit = transit

    def entry(self, kid: str) -> str:
        if self.transit is None:
            return generate_key_text(kid)
        return wrap_new_key("", self.transit, "svc", kid)

    def ring(self, text: str) -> Keyring:
        return Keyring.parse(text) if self.transit is None else unwrap_keyring(text, self.transit, "svc")


@pytest.fixture(params=["env", pytest.param("vault", marks=pytest.mark.integration)])
def source(request: pytest.FixtureRequest) -> KeySource:
    if request.param == "env":
        return KeySource()
    box = request.getfixturevalue("vault")  # this test's own Transit mount on the session's OpenBao
    box.transit_key("svc")
    return KeySource(TransitKey(VaultClient(box.token_config()), box.transit, "svc"))


def test_sealed_values_are_bound_to_their_row_and_key(source: KeySource) -> None:
    ring = source.ring(source.entry("a"))
    sealed = ring.seal("s3cret-value", "t.c:row1")
    assert is_sealed(sealed) and "s3cret" not in sealed and sealed.startswith("gpuaas:enc:v1:a:")
    assert ring.open(sealed, "t.c:row1") == "s3cret-value"
    with pytest.raises(SecretsKeyError, match="does not open"):  # copied to another row
        ring.open(sealed, "t.c:row2")
    with pytest.raises(SecretsKeyError, match="does not open"):  # same key id, other key bytes
        source.ring(source.entry("a")).open(sealed, "t.c:row1")
    with pytest.raises(SecretsKeyError, match="does not hold"):
        source.ring(source.entry("b")).open(sealed, "t.c:row1")
    doc = {"d": "private", "kty": "EC"}
    assert ring.open_json(ring.seal_json(doc, "ctx"), "ctx") == doc


def test_rotation_opens_old_values_and_seals_with_the_first_key(source: KeySource) -> None:
    old, new = source.entry("old"), source.entry("new")
    sealed = source.ring(old).seal("v", "ctx")
    rotated = source.ring(f"{new},{old}")
    assert rotated.open(sealed, "ctx") == "v" and rotated.needs_reseal(sealed)
    assert not rotated.needs_reseal(rotated.seal("v", "ctx"))


@pytest.mark.integration
def test_a_transit_rotation_rewraps_the_data_keys_without_changing_them(vault) -> None:
    """The Vault source's own rotation: the Transit key rotates, the wrapped keyring moves to the new version
    (`rewrap_keyring`), the data keys stay the same (values sealed before still open), and once the old
    version is retired only the re-wrapped keyring unwraps."""
    vault.transit_key("svc")
    transit = TransitKey(VaultClient(vault.token_config()), vault.transit, "svc")
    text = wrap_new_key(wrap_new_key("", transit, "svc", "k1"), transit, "svc", "k2")
    sealed = unwrap_keyring(text, transit, "svc").seal("v", "ctx")
    assert vault.rotate("svc") == 2
    moved = rewrap_keyring(text, transit, "svc")
    assert all(ciphertext_version(w) == 2 for _, w in wrapped_entries(moved))
    vault.root.secrets.transit.update_key_configuration(name="svc", min_decryption_version=2, mount_point=vault.transit)
    assert unwrap_keyring(moved, transit, "svc").open(sealed, "ctx") == "v"
    with pytest.raises(SecretsUnavailable):  # the retired version no longer unwraps
        unwrap_keyring(text, transit, "svc")
    with pytest.raises(SecretsUnavailable):  # a data key moved to another key id: another context
        unwrap_keyring(moved.replace("k1:", "kx:", 1), transit, "svc")


def test_signature_covers_the_canonical_envelope_and_names_the_owner() -> None:
    seed = generate_seed()
    signer, verifier = EventSigner(seed), EventVerifier.parse(f"identity:{public_of(seed)}")
    event = platform_admin(__import__("uuid").uuid4())
    signed = json.loads(signer.sign_payload(event.model_dump_json().encode()))
    verifier.verify(IDENTITY, signed)  # genuine: accepted
    forged = {**signed, "data": {**signed["data"], "user_id": str(__import__("uuid").uuid4())}}
    with pytest.raises(SignatureError, match="does not verify"):
        verifier.verify(IDENTITY, forged)
    unsigned = {k: v for k, v in signed.items() if k != "signature"}
    with pytest.raises(SignatureError, match="unsigned"):
        verifier.verify(IDENTITY, unsigned)
    other = EventSigner(generate_seed())  # a compromised service signing as itself
    with pytest.raises(SignatureError, match="not a key of 'identity'"):
        verifier.verify(IDENTITY, json.loads(other.sign_payload(event.model_dump_json().encode())))
    spoofed = json.loads(
        other.sign_payload(event.model_copy(update={"source": "allocations"}).model_dump_json().encode())
    )
    with pytest.raises(SignatureError, match=r"source 'allocations' may not emit 'membership\.granted'"):
        verifier.verify(IDENTITY, spoofed)
    # Fields this consumer's contracts do not know are covered too (the signature is over the bytes as sent).
    extended = json.loads(signer.sign_payload(json.dumps({**unsigned, "new_field": 1}).encode()))
    verifier.verify(IDENTITY, extended)
    with pytest.raises(SignatureError):
        verifier.verify(IDENTITY, {**extended, "new_field": 2})
    assert ev.MembershipGranted.model_validate(signed).signature == signed["signature"]


def test_responses_with_secrets_are_recognised() -> None:
    assert holds_secret([], b'{"service_account_id": "x", "client_secret": "abc"}')
    assert holds_secret([], b'{"items": [{"credential": {"private_key": "-----BEGIN"}}]}')
    assert holds_secret([(b"cache-control", b"no-store")], b'{"id": 1}')
    assert not holds_secret([], b'{"id": 1, "client_secret": null}')
    assert not holds_secret([(b"content-type", b"application/json")], b'{"allocation_id": "a"}')


def test_a_genuine_signature_of_a_service_that_may_not_emit_the_type_is_refused() -> None:
    """The source table (gpuaas.contracts.emitters): allocations' own valid signature on an access grant of the
    app-runtime topic is refused; app-runtime's is accepted; the key must be the named source's."""
    from gpuaas.contracts.emitters import ACCESS_OR_MONEY, may_emit
    from gpuaas.contracts.events import app_runtime as ar
    from gpuaas.contracts.registry import APP_RUNTIME

    seeds = {s: generate_seed() for s in ("app-runtime", "allocations")}
    verifier = EventVerifier.parse(",".join(f"{s}:{public_of(k)}" for s, k in seeds.items()))
    doc = {"id": "x", "type": ar.AccessGrantRequested.event_type(), "data": {}, "source": "app-runtime"}
    genuine = json.loads(EventSigner(seeds["app-runtime"]).sign_payload(json.dumps(doc).encode()))
    verifier.verify(APP_RUNTIME, genuine)
    as_itself = {**doc, "source": "allocations"}
    with pytest.raises(SignatureError, match=r"source 'allocations' may not emit 'access_grant\.requested'"):
        verifier.verify(
            APP_RUNTIME, json.loads(EventSigner(seeds["allocations"]).sign_payload(json.dumps(as_itself).encode()))
        )
    with pytest.raises(SignatureError, match="not a key of 'app-runtime'"):
        verifier.verify(
            APP_RUNTIME, json.loads(EventSigner(seeds["allocations"]).sign_payload(json.dumps(doc).encode()))
        )
    assert may_emit("app-runtime", APP_RUNTIME, "instance.created")
    assert not may_emit("allocations", APP_RUNTIME, "instance.created")
    assert "access_grant.requested" in ACCESS_OR_MONEY[APP_RUNTIME]
