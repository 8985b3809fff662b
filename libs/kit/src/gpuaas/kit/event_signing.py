"""Envelope signatures: an event on a topic that changes access or money is accepted only from a service the
contracts allow to emit that type there (gpuaas.contracts.emitters), signed with that service's key.

- Every service's relay signs what it publishes on the authenticated topics with its own Ed25519 key
  (`GPUAAS_<SERVICE>_EVENT_SIGNING_KEY`, base64 of the 32-byte seed). Ed25519, not HMAC: a consumer holds
  only public keys, so a compromised consumer cannot forge another service's events.
- The signature covers the canonical bytes of the envelope: the JSON document without `signature`, keys
  sorted, no spaces, UTF-8 (`canonical_bytes`). It is computed on the document as sent, so fields a
  consumer's contracts do not know are covered too (the `source` and `type` included).
- `envelope.signature` = `ed25519:<kid>:<base64 signature>`; kid = first 16 hex digits of the SHA-256 of
  the public key, so a key's id is never configured by hand.
- Consumers check two things on the topics in `SIGNED_TOPICS`: the envelope's `source` may emit its `type`
  on that topic (`emitters.may_emit`), and the signature verifies under one of that source's public keys
  (`GPUAAS_EVENT_VERIFY_KEYS` = `service:base64(public key)[,...]`; several per service while rotating).
  An unsigned event, one signed by another service's key, a wrong signature, or a genuine signature of a
  service that may not emit that type there is dead-lettered with the reason, never applied.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from gpuaas.contracts.emitters import AUTHENTICATED_TOPICS, emitters_of

# Topics whose events change access or money: their consumers accept only signed events of a listed emitter.
SIGNED_TOPICS = AUTHENTICATED_TOPICS
ALGORITHM = "ed25519"


class SignatureError(ValueError):
    """An event on a signed topic is unsigned, signed by someone else, its signature does not verify, or its
    source may not emit its type on that topic."""


def canonical_bytes(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(
        {k: v for k, v in doc.items() if k != "signature"}, sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode()


def key_id(public: Ed25519PublicKey) -> str:
    return hashlib.sha256(public.public_bytes(Encoding.Raw, PublicFormat.Raw)).hexdigest()[:16]


def generate_seed() -> str:
    """A fresh signing key (base64 of the Ed25519 seed), for the local stack and tests."""
    from cryptography.hazmat.primitives.serialization import NoEncryption, PrivateFormat

    raw = Ed25519PrivateKey.generate().private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    return base64.b64encode(raw).decode()


def public_of(seed_b64: str) -> str:
    """The base64 public key of a signing key, as listed in `GPUAAS_EVENT_VERIFY_KEYS`."""
    public = _private(seed_b64, "signing key").public_key()
    return base64.b64encode(public.public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()


def _private(seed_b64: str, what: str) -> Ed25519PrivateKey:
    try:
        raw = base64.b64decode(seed_b64, validate=True)
        return Ed25519PrivateKey.from_private_bytes(raw)
    except (binascii.Error, ValueError):
        raise ValueError(f"{what}: base64 of a 32-byte Ed25519 seed expected") from None


class EventSigner:
    """Signs a service's outgoing envelopes (the relay calls `sign_payload` on each outbox row)."""

    def __init__(self, seed_b64: str) -> None:
        self._key = _private(seed_b64, "event_signing_key")
        self.kid = key_id(self._key.public_key())

    def replace(self, seed_b64: str) -> None:
        """Sign with another key from now on (a rotation followed from Vault; the relay keeps this object)."""
        key = _private(seed_b64, "event_signing_key")
        self._key, self.kid = key, key_id(key.public_key())

    def signature(self, doc: Mapping[str, Any]) -> str:
        sig = self._key.sign(canonical_bytes(doc))
        return f"{ALGORITHM}:{self.kid}:{base64.b64encode(sig).decode()}"

    def sign_payload(self, payload: bytes) -> bytes:
        doc = json.loads(payload)
        doc["signature"] = self.signature(doc)
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass
class EventVerifier:
    """Public keys by producing service and key id."""

    keys: dict[str, dict[str, Ed25519PublicKey]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> EventVerifier:
        verifier = cls()
        for entry in (e.strip() for e in text.split(",")):
            if not entry:
                continue
            service, sep, b64 = entry.partition(":")
            if not sep or not service:
                raise ValueError("event_verify_keys: each entry is `service:base64(public key)`")
            try:
                public = Ed25519PublicKey.from_public_bytes(base64.b64decode(b64, validate=True))
            except (binascii.Error, ValueError):
                raise ValueError(f"event_verify_keys: the key of {service!r} is not a base64 Ed25519 key") from None
            verifier.keys.setdefault(service, {})[key_id(public)] = public
        return verifier

    def trusts(self, service: str) -> bool:
        return bool(self.keys.get(service))

    def verify(self, topic: str, doc: Mapping[str, Any]) -> None:
        """Raise SignatureError unless `doc` (the envelope as received) comes from a service that may emit its
        type on `topic` and carries that service's valid signature."""
        source, event_type = doc.get("source"), doc.get("type")
        allowed = emitters_of(topic, str(event_type))
        if not isinstance(source, str) or source not in allowed:
            only = ", ".join(sorted(allowed)) or "nobody"
            raise SignatureError(f"source {source!r} may not emit {event_type!r} on {topic} (only {only})")
        signature = doc.get("signature")
        if not isinstance(signature, str):
            raise SignatureError(f"unsigned event on {topic} (only {source!r}'s signed events are accepted)")
        alg, _, rest = signature.partition(":")
        kid, _, b64 = rest.partition(":")
        public = self.keys.get(source, {}).get(kid)
        if alg != ALGORITHM or public is None:
            raise SignatureError(f"event on {topic} signed with key {kid!r}, not a key of {source!r}")
        try:
            public.verify(base64.b64decode(b64, validate=True), canonical_bytes(doc))
        except (InvalidSignature, binascii.Error, ValueError):
            raise SignatureError(f"event on {topic}: the signature does not verify") from None


def main(argv: list[str] | None = None) -> int:
    """`python -m gpuaas.kit.event_signing keygen SERVICE...`: a signing key per service (for its
    GPUAAS_<SERVICE>_EVENT_SIGNING_KEY, a secret) and the GPUAAS_EVENT_VERIFY_KEYS line (public)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] != "keygen" or len(args) < 2:
        print("usage: python -m gpuaas.kit.event_signing keygen SERVICE [SERVICE...]", file=sys.stderr)
        return 2
    seeds = {service: generate_seed() for service in args[1:]}
    for service, seed in seeds.items():
        print(f"{service}: {seed}")
    print("verify keys: " + ",".join(f"{s}:{public_of(seed)}" for s, seed in seeds.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
