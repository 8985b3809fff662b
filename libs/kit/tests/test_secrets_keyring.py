"""Unit tests of the secrets-at-rest keyring (gpuaas.kit.secrets_at_rest) and the envelope signatures
(gpuaas.kit.event_signing): no default key, bound associated data, rotation, canonical bytes."""

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


def test_missing_malformed_and_published_keys_are_refused() -> None:
    with pytest.raises(SecretsKeyError, match="GPUAAS_SECRETS_KEYS is not set"):
        Keyring.parse("")
    with pytest.raises(SecretsKeyError, match="kid:base64key"):
        Keyring.parse(base64.b64encode(os.urandom(32)).decode())
    with pytest.raises(SecretsKeyError, match="32 bytes"):
        Keyring.parse("k:" + base64.b64encode(os.urandom(16)).decode())
    with pytest.raises(SecretsKeyError, match="published development key"):
        Keyring.parse("k:ZGV2LW9ubHkta2VrLWRvLW5vdC11c2UtaW4tcHJvZCE=")


def test_sealed_values_are_bound_to_their_row_and_key() -> None:
    ring = Keyring.parse(generate_key_text("a"))
    sealed = ring.seal("s3cret-value", "t.c:row1")
    assert is_sealed(sealed) and "s3cret" not in sealed and sealed.startswith("gpuaas:enc:v1:a:")
    assert ring.open(sealed, "t.c:row1") == "s3cret-value"
    with pytest.raises(SecretsKeyError, match="does not open"):  # copied to another row
        ring.open(sealed, "t.c:row2")
    with pytest.raises(SecretsKeyError, match="does not open"):  # same key id, other key bytes
        Keyring.parse(generate_key_text("a")).open(sealed, "t.c:row1")
    with pytest.raises(SecretsKeyError, match="does not hold"):
        Keyring.parse(generate_key_text("b")).open(sealed, "t.c:row1")
    doc = {"d": "private", "kty": "EC"}
    assert ring.open_json(ring.seal_json(doc, "ctx"), "ctx") == doc


def test_rotation_opens_old_values_and_seals_with_the_first_key() -> None:
    old, new = generate_key_text("old"), generate_key_text("new")
    sealed = Keyring.parse(old).seal("v", "ctx")
    rotated = Keyring.parse(f"{new},{old}")
    assert rotated.open(sealed, "ctx") == "v" and rotated.needs_reseal(sealed)
    assert not rotated.needs_reseal(rotated.seal("v", "ctx"))


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
