"""Artifact trust against the OCI distribution API: digest-pinned references, content
verification by hashing every byte we are served, and cosign-compatible key-pair signatures.

A registry does not verify what it serves (a blob overwritten in its storage is still served
under its old digest), so nothing here trusts a registry's word: manifests and blobs are
downloaded and hashed, and sizes are compared with their descriptors.

Redirects are followed (registries send blob downloads to their storage), but one that leaves the
registry's own host goes through the outbound guard (`gpuaas.kit.outbound`, as identity's calls to IdPs):
an address denied by default (loopback, private, link-local such as cloud metadata...) is refused unless
the operator allows its network, and plain http only to the plain-http hosts; a refusal is TrustError
`registry_redirect_refused`. The registry a reference names is the operator's (publishers are operators)
and is reached as configured.

The push helpers (`push_blob`, `push_manifest`, `push_image`, `push_blob_artifact`,
`push_cosign_signature`) put fixed bytes into a registry without Docker; the catalog seed and the
tests use them.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import re
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from gpuaas.kit.logging import get_logger
from gpuaas.kit.outbound import OutboundError, OutboundPolicy, PinnedTransport, check_url

log = get_logger(__name__)

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_EMPTY = "application/vnd.oci.empty.v1+json"
COSIGN_PAYLOAD = "application/vnd.dev.cosign.simplesigning.v1+json"
COSIGN_SIGNATURE_ANNOTATION = "dev.cosignproject.cosign/signature"
ACCEPT = ", ".join([OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST])
MAX_MANIFEST_BYTES = 4 * 1024 * 1024

DIGEST_RE = re.compile(r"^(sha256:[0-9a-f]{64}|sha512:[0-9a-f]{128})$")
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
REPOSITORY_RE = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
REGISTRY_RE = re.compile(
    r"^(?:localhost|\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+\.[A-Za-z0-9.-]+|[A-Za-z0-9.-]+)(?::[0-9]{1,5})?$"
)


class TrustError(Exception):
    """An artifact failed a trust check (or could not be checked). `status` is the HTTP status to answer."""

    def __init__(self, code: str, detail: str, status: int = 422) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail
        self.status = status


@dataclass(frozen=True)
class Reference:
    registry: str
    repository: str
    digest: str

    @property
    def ref(self) -> str:
        return f"{self.registry}/{self.repository}@{self.digest}"


def parse_ref(ref: str) -> Reference:
    """`registry[:port]/repo[/...]@sha256:<64 hex>`; a tag (movable) is refused with a clear reason."""
    ref = ref.strip()
    name, at, digest = ref.partition("@")
    if not at:
        last = name.rsplit("/", 1)[-1]
        hint = f" (it names the tag {last.split(':', 1)[1]!r}, which can move)" if ":" in last else ""
        raise TrustError(
            "artifact_ref_not_pinned",
            f"{ref!r} is not pinned by digest{hint}; reference it as registry/repository@sha256:<64 hex>",
        )
    if not DIGEST_RE.match(digest):
        raise TrustError(
            "artifact_ref_invalid_digest", f"{digest!r} is not a digest (expected sha256:<64 lowercase hex>)"
        )
    registry, slash, repository = name.partition("/")
    if not slash or not ("." in registry or ":" in registry or registry == "localhost"):
        raise TrustError(
            "artifact_ref_no_registry", f"{ref!r} must start with the registry host, e.g. registry.example.com/repo@..."
        )
    if not REGISTRY_RE.match(registry):
        raise TrustError("artifact_ref_invalid", f"{registry!r} is not a registry host[:port]")
    last = repository.rsplit("/", 1)[-1]
    if ":" in last:
        raise TrustError(
            "artifact_ref_invalid", f"{ref!r} carries both a tag and a digest; drop the tag, the digest decides"
        )
    if not REPOSITORY_RE.match(repository) or len(repository) > 255:
        raise TrustError("artifact_ref_invalid", f"{repository!r} is not a valid repository name")
    return Reference(registry=registry, repository=repository, digest=digest)


def digest_of(data: bytes, algorithm: str = "sha256") -> str:
    return f"{algorithm}:{hashlib.new(algorithm, data).hexdigest()}"


@dataclass
class Verified:
    """What content verification established about an artifact."""

    reference: Reference
    media_type: str
    artifact_type: str | None
    size_bytes: int
    blobs_verified: int
    manifest: dict[str, Any] | None = None
    detail: list[str] = field(default_factory=list)


@dataclass
class SignatureResult:
    verified: bool
    detail: str


MAX_REDIRECTS = 5


class _GuardedRedirects(httpx.AsyncBaseTransport):
    """The registry's own host directly; any other host (a redirect's target) through the outbound guard."""

    def __init__(self, own: httpx.URL, policy: OutboundPolicy) -> None:
        self.own = (own.host, own.port or _default_port(own.scheme))
        self.policy = policy
        self.direct = httpx.AsyncHTTPTransport()  # as before: SSL_CERT_FILE/DIR honoured for the registry
        self.guarded = PinnedTransport(policy)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if (request.url.host, request.url.port or _default_port(request.url.scheme)) == self.own:
            return await self.direct.handle_async_request(request)
        check_url(str(request.url), self.policy)
        return await self.guarded.handle_async_request(request)

    async def aclose(self) -> None:
        await self.direct.aclose()
        await self.guarded.aclose()


def _default_port(scheme: str) -> int:
    return 443 if scheme == "https" else 80


class RegistryClient:
    """A small OCI distribution API client that hashes everything it is served.

    `allowed_networks`: CIDRs a redirect may lead to although denied by default (e.g. the storage of a
    registry inside the company network)."""

    def __init__(
        self,
        plain_http_hosts: list[str] | None = None,
        timeout_s: float = 30.0,
        allowed_networks: Sequence[str] = (),
    ) -> None:
        self.plain_http_hosts = set(plain_http_hosts or [])
        self.timeout_s = timeout_s
        self.redirect_policy = OutboundPolicy(
            allowed_networks=tuple(allowed_networks), plain_http_hosts=tuple(self.plain_http_hosts)
        )

    def base_url(self, registry: str) -> str:
        host = registry.rsplit(":", 1)[0] if not registry.endswith("]") else registry
        scheme = "http" if host in self.plain_http_hosts or registry in self.plain_http_hosts else "https"
        return f"{scheme}://{registry}"

    def _client(self, registry: str) -> httpx.AsyncClient:
        base = httpx.URL(self.base_url(registry))
        return httpx.AsyncClient(
            base_url=base,
            timeout=self.timeout_s,
            follow_redirects=True,
            max_redirects=MAX_REDIRECTS,
            transport=_GuardedRedirects(base, self.redirect_policy),
        )

    # ------------------------------------------------------------------------------- verification

    async def verify(self, ref: Reference, *, allow_raw_blob: bool = False) -> Verified:
        """Download the manifest by digest and every blob it names; hash and size-check each.

        With `allow_raw_blob` (non-OCI artifacts), a digest that is not a manifest may name a blob
        directly (e.g. model weights pushed as one blob); that blob is downloaded and hashed.
        """
        try:
            async with self._client(ref.registry) as client:
                raw, media_type = await self._get_manifest(client, ref.repository, ref.digest, lenient=True)
                if raw is None:
                    # Registry 2.8 answers 500 (not 404) when a blob's digest is asked for as a manifest.
                    is_blob = (await client.head(f"/v2/{ref.repository}/blobs/{ref.digest}")).status_code == 200
                    if not is_blob:
                        if media_type == "error":
                            raise TrustError("registry_error", f"the registry failed to serve {ref.digest}", 502)
                        raise TrustError(
                            "artifact_manifest_unknown",
                            f"the registry has no manifest {ref.digest} in {ref.repository!r}",
                        )
                    if not allow_raw_blob:
                        raise TrustError(
                            "artifact_not_a_manifest",
                            f"{ref.digest} is a plain blob, not an image manifest; register it as a blob artifact",
                        )
                    size = await self._verify_blob(client, ref.repository, ref.digest, None, "artifact blob")
                    return Verified(ref, "application/octet-stream", None, size, 1, None, ["raw blob verified"])
                manifest = _manifest_json(raw)
                media_type = manifest.get("mediaType") or media_type
                size, blobs, detail = len(raw), 0, []
                if media_type in (OCI_INDEX, DOCKER_LIST) or "manifests" in manifest:
                    for child in manifest.get("manifests", []):
                        child_digest = _descriptor_digest(child)
                        child_raw, _ = await self._get_manifest(client, ref.repository, child_digest)
                        if child_raw is None:
                            raise TrustError(
                                "artifact_manifest_unknown", f"index entry {child_digest} is missing from the registry"
                            )
                        _check_descriptor(child, child_raw, "index entry")
                        s, b = await self._verify_image(client, ref.repository, _manifest_json(child_raw))
                        size, blobs = size + len(child_raw) + s, blobs + b
                    detail.append(f"index of {len(manifest.get('manifests', []))} manifests verified")
                else:
                    s, b = await self._verify_image(client, ref.repository, manifest)
                    size, blobs = size + s, blobs + b
                artifact_type = manifest.get("artifactType") or (manifest.get("config") or {}).get("mediaType")
                detail.append(f"manifest and {blobs} blobs hashed ({size} bytes)")
                return Verified(ref, media_type or OCI_MANIFEST, artifact_type, size, blobs, manifest, detail)
        except OutboundError as exc:
            raise _redirect_refused(ref.registry, exc) from exc
        except httpx.TransportError as exc:
            raise TrustError(
                "registry_unreachable", f"the registry {ref.registry} cannot be reached: {exc}", status=503
            ) from exc

    async def _get_manifest(
        self, client: httpx.AsyncClient, repo: str, digest: str, lenient: bool = False
    ) -> tuple[bytes | None, str]:
        resp = await client.get(f"/v2/{repo}/manifests/{digest}", headers={"Accept": ACCEPT})
        if resp.status_code == 404:
            return None, ""
        if lenient and resp.status_code == 500:
            return None, "error"
        _raise_for_registry(resp, f"manifest {digest}")
        raw = resp.content
        if len(raw) > MAX_MANIFEST_BYTES:
            raise TrustError("artifact_manifest_too_large", f"the manifest is {len(raw)} bytes; the limit is 4 MiB")
        served = digest_of(raw, digest.split(":", 1)[0])
        if served != digest:
            raise TrustError(
                "artifact_digest_mismatch",
                f"the registry served a manifest whose digest is {served}, not the pinned {digest}: refused",
            )
        return raw, resp.headers.get("content-type", "").split(";")[0]

    async def _verify_image(self, client: httpx.AsyncClient, repo: str, manifest: dict[str, Any]) -> tuple[int, int]:
        descriptors = []
        if isinstance(manifest.get("config"), dict):
            descriptors.append(("config", manifest["config"]))
        descriptors += [(f"layer {i}", d) for i, d in enumerate(manifest.get("layers") or [])]
        if not descriptors:
            raise TrustError("artifact_manifest_invalid", "the manifest names neither a config nor layers")
        total = 0
        for what, desc in descriptors:
            if not isinstance(desc, dict):
                raise TrustError("artifact_manifest_invalid", f"{what} is not a descriptor")
            total += await self._verify_blob(client, repo, _descriptor_digest(desc), desc.get("size"), what)
        return total, len(descriptors)

    async def _verify_blob(self, client: httpx.AsyncClient, repo: str, digest: str, size: Any, what: str) -> int:
        algorithm = digest.split(":", 1)[0]
        hasher = hashlib.new(algorithm)
        n = 0
        async with client.stream("GET", f"/v2/{repo}/blobs/{digest}") as resp:
            if resp.status_code == 404:
                raise TrustError("artifact_blob_missing", f"{what} ({digest}) is missing from the registry")
            if resp.status_code >= 400:
                await resp.aread()
            _raise_for_registry(resp, f"{what} {digest}")
            async for chunk in resp.aiter_bytes(1 << 20):
                hasher.update(chunk)
                n += len(chunk)
        served = f"{algorithm}:{hasher.hexdigest()}"
        if served != digest:
            raise TrustError(
                "artifact_content_tampered",
                f"{what}: the registry served bytes hashing to {served}, not {digest}: the content was altered",
            )
        if isinstance(size, int) and size != n:
            raise TrustError("artifact_content_tampered", f"{what}: served {n} bytes, the descriptor says {size}")
        return n

    # ---------------------------------------------------------------------------------- signatures

    async def verify_signature(self, ref: Reference, public_key_pem: str) -> SignatureResult:
        """Verify a cosign key-pair signature: the `sha256-<hex>.sig` tag in the artifact's repository
        holds a simple-signing payload naming the digest, signed (ECDSA P-256/SHA-256) in an annotation."""
        try:
            key = serialization.load_pem_public_key(public_key_pem.encode())
        except (ValueError, TypeError) as exc:
            raise TrustError("signature_key_invalid", f"the public key is not a PEM public key: {exc}") from exc
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise TrustError("signature_key_invalid", "only ECDSA public keys (cosign key pairs) are supported")
        tag = ref.digest.replace(":", "-") + ".sig"
        try:
            async with self._client(ref.registry) as client:
                resp = await client.get(f"/v2/{ref.repository}/manifests/{tag}", headers={"Accept": ACCEPT})
                if resp.status_code == 404:
                    return SignatureResult(False, f"no signature ({tag}) in {ref.repository}")
                _raise_for_registry(resp, f"signature {tag}")
                manifest = _manifest_json(resp.content)
                for layer in manifest.get("layers") or []:
                    signature = (layer.get("annotations") or {}).get(COSIGN_SIGNATURE_ANNOTATION)
                    if layer.get("mediaType") != COSIGN_PAYLOAD or not signature:
                        continue
                    payload_digest = _descriptor_digest(layer)
                    payload = (await client.get(f"/v2/{ref.repository}/blobs/{payload_digest}")).content
                    if digest_of(payload, payload_digest.split(":", 1)[0]) != payload_digest:
                        return SignatureResult(False, "the signature payload was altered in the registry")
                    try:
                        claimed = json.loads(payload)["critical"]["image"]["docker-manifest-digest"]
                    except (ValueError, KeyError, TypeError):
                        continue
                    if claimed != ref.digest:
                        continue
                    try:
                        key.verify(base64.b64decode(signature), payload, ec.ECDSA(hashes.SHA256()))
                    except (InvalidSignature, ValueError):
                        continue
                    return SignatureResult(True, f"cosign signature over {ref.digest} verified with the given key")
                return SignatureResult(False, "no signature in the registry verifies with the given key")
        except OutboundError as exc:
            raise _redirect_refused(ref.registry, exc) from exc
        except httpx.TransportError as exc:
            raise TrustError(
                "registry_unreachable", f"the registry {ref.registry} cannot be reached: {exc}", 503
            ) from exc

    # -------------------------------------------------------------------------------------- pushing

    async def push_blob(self, registry: str, repo: str, data: bytes) -> str:
        digest = digest_of(data)
        async with self._client(registry) as client:
            if (await client.head(f"/v2/{repo}/blobs/{digest}")).status_code == 200:
                return digest
            start = await client.post(f"/v2/{repo}/blobs/uploads/")
            _raise_for_registry(start, "blob upload")
            location = start.headers["location"]
            # httpx 0.28 drops the upload's `_state` query when `params=` is used: append by hand.
            url = location + ("&" if "?" in location else "?") + "digest=" + digest
            done = await client.put(url, content=data, headers={"Content-Type": "application/octet-stream"})
            _raise_for_registry(done, "blob upload")
        return digest

    async def push_manifest(self, registry: str, repo: str, manifest: bytes, media_type: str, tag: str | None) -> str:
        digest = digest_of(manifest)
        async with self._client(registry) as client:
            resp = await client.put(
                f"/v2/{repo}/manifests/{tag or digest}", content=manifest, headers={"Content-Type": media_type}
            )
            _raise_for_registry(resp, "manifest upload")
        return digest

    async def push_image(
        self,
        registry: str,
        repo: str,
        files: Mapping[str, bytes],
        *,
        tag: str | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> Reference:
        """A one-layer OCI image of `files`, with fixed timestamps (same input → same digest)."""
        layer_tar = _tar(files)
        layer = _gzip(layer_tar)
        config = _canonical(
            {
                "architecture": "amd64",
                "os": "linux",
                "config": {"Labels": dict(labels or {})},
                "rootfs": {"type": "layers", "diff_ids": [digest_of(layer_tar)]},
            }
        )
        config_digest = await self.push_blob(registry, repo, config)
        layer_digest = await self.push_blob(registry, repo, layer)
        manifest = _canonical(
            {
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": len(config)},
                "layers": [{"mediaType": OCI_LAYER_GZIP, "digest": layer_digest, "size": len(layer)}],
            }
        )
        digest = await self.push_manifest(registry, repo, manifest, OCI_MANIFEST, tag)
        return Reference(registry, repo, digest)

    async def push_blob_artifact(
        self,
        registry: str,
        repo: str,
        data: bytes,
        *,
        artifact_type: str,
        filename: str,
        tag: str | None = None,
        layer_media_type: str = "application/octet-stream",
    ) -> Reference:
        """A non-container artifact (weights, dataset, script) as an OCI artifact manifest."""
        empty = b"{}"
        await self.push_blob(registry, repo, empty)
        blob_digest = await self.push_blob(registry, repo, data)
        manifest = _canonical(
            {
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "artifactType": artifact_type,
                "config": {"mediaType": OCI_EMPTY, "digest": digest_of(empty), "size": 2},
                "layers": [
                    {
                        "mediaType": layer_media_type,
                        "digest": blob_digest,
                        "size": len(data),
                        "annotations": {"org.opencontainers.image.title": filename},
                    }
                ],
            }
        )
        digest = await self.push_manifest(registry, repo, manifest, OCI_MANIFEST, tag)
        return Reference(registry, repo, digest)

    async def push_cosign_signature(self, ref: Reference, private_key: ec.EllipticCurvePrivateKey) -> None:
        """Sign `ref` the way `cosign sign --key` stores a signature (simple signing payload + annotation)."""
        payload = _canonical(
            {
                "critical": {
                    "identity": {"docker-reference": f"{ref.registry}/{ref.repository}"},
                    "image": {"docker-manifest-digest": ref.digest},
                    "type": "cosign container image signature",
                },
                "optional": None,
            }
        )
        signature = base64.b64encode(private_key.sign(payload, ec.ECDSA(hashes.SHA256()))).decode()
        empty = b"{}"
        await self.push_blob(ref.registry, ref.repository, empty)
        payload_digest = await self.push_blob(ref.registry, ref.repository, payload)
        manifest = _canonical(
            {
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "config": {"mediaType": OCI_EMPTY, "digest": digest_of(empty), "size": 2},
                "layers": [
                    {
                        "mediaType": COSIGN_PAYLOAD,
                        "digest": payload_digest,
                        "size": len(payload),
                        "annotations": {COSIGN_SIGNATURE_ANNOTATION: signature},
                    }
                ],
            }
        )
        await self.push_manifest(
            ref.registry, ref.repository, manifest, OCI_MANIFEST, ref.digest.replace(":", "-") + ".sig"
        )


def _redirect_refused(registry: str, exc: OutboundError) -> TrustError:
    # The guard's reason (address, port) is for the operator's log, not the caller: a generic refusal.
    log.warning("registry_redirect_refused", registry=registry, reason=exc.reason, detail=exc.detail)
    return TrustError(
        "registry_redirect_refused",
        f"the registry {registry} redirected to a location the catalog may not reach (registry_allowed_networks)",
        502,
    )


def _raise_for_registry(resp: httpx.Response, what: str) -> None:
    if resp.status_code < 400:
        return
    if resp.status_code in (401, 403):
        raise TrustError("registry_unauthorized", f"the registry refused access to {what} ({resp.status_code})", 502)
    try:
        errors = ", ".join(e.get("code", "") for e in resp.json().get("errors", []))
    except ValueError:
        errors = ""
    raise TrustError("registry_error", f"the registry answered {resp.status_code} {errors} for {what}", 502)


def _manifest_json(raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise TrustError("artifact_manifest_invalid", "the manifest is not JSON") from exc
    if not isinstance(doc, dict) or doc.get("schemaVersion") != 2:
        raise TrustError("artifact_manifest_invalid", "the manifest is not an OCI/Docker schema 2 manifest")
    return doc


def _descriptor_digest(desc: Any) -> str:
    digest = desc.get("digest") if isinstance(desc, dict) else None
    if not isinstance(digest, str) or not DIGEST_RE.match(digest):
        raise TrustError("artifact_manifest_invalid", f"a descriptor carries no valid digest: {digest!r}")
    return digest


def _check_descriptor(desc: dict[str, Any], raw: bytes, what: str) -> None:
    if isinstance(desc.get("size"), int) and desc["size"] != len(raw):
        raise TrustError(
            "artifact_content_tampered", f"{what}: {len(raw)} bytes served, descriptor says {desc['size']}"
        )


def _canonical(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _tar(files: Mapping[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(files[name]), 0, 0o644
            tar.addfile(info, io.BytesIO(files[name]))
    return buf.getvalue()


def _gzip(data: bytes) -> bytes:
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz:
        gz.write(data)
    return buf.getvalue()
