"""Push a controller's package to an OCI registry as an artifact (no docker, skopeo or oras needed), so it can
be registered in the catalog pinned by digest: `ref = await push_artifact("127.0.0.1:5050", "apps/echo", data)`.
Plain HTTP for loopback registries (`make run`'s), HTTPS otherwise; no registry auth (add a bearer in
`headers` if yours needs one)."""

from __future__ import annotations

import hashlib
import json

import httpx

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_EMPTY = "application/vnd.oci.empty.v1+json"


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _base_url(registry: str) -> str:
    host = registry.split(":")[0]
    scheme = "http" if host in ("127.0.0.1", "localhost", "::1") else "https"
    return f"{scheme}://{registry}"


async def _push_blob(http: httpx.AsyncClient, repo: str, data: bytes) -> str:
    digest = digest_of(data)
    if (await http.head(f"/v2/{repo}/blobs/{digest}")).status_code == 200:
        return digest
    start = await http.post(f"/v2/{repo}/blobs/uploads/")
    start.raise_for_status()
    location = start.headers["location"]
    # httpx drops the upload's own query (`_state`) when `params=` is used: append the digest by hand
    done = await http.put(
        location + ("&" if "?" in location else "?") + "digest=" + digest,
        content=data,
        headers={"Content-Type": "application/octet-stream"},
    )
    done.raise_for_status()
    return digest


async def push_artifact(
    registry: str,
    repo: str,
    data: bytes,
    *,
    filename: str = "controller.tar.gz",
    artifact_type: str = "application/vnd.gpuaas.controller.v1",
    tag: str | None = None,
    headers: dict[str, str] | None = None,
) -> str:
    """Push `data` as a one-layer OCI artifact; answers its reference pinned by digest
    (`registry/repo@sha256:...`), which is what `Client.register_artifact` takes."""
    empty = b"{}"
    async with httpx.AsyncClient(base_url=_base_url(registry), headers=headers, timeout=60) as http:
        await _push_blob(http, repo, empty)
        layer = await _push_blob(http, repo, data)
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "artifactType": artifact_type,
                "config": {"mediaType": OCI_EMPTY, "digest": digest_of(empty), "size": len(empty)},
                "layers": [
                    {
                        "mediaType": "application/octet-stream",
                        "digest": layer,
                        "size": len(data),
                        "annotations": {"org.opencontainers.image.title": filename},
                    }
                ],
            },
            sort_keys=True,
            separators=(",", ":"),
        ).encode()
        digest = digest_of(manifest)
        r = await http.put(
            f"/v2/{repo}/manifests/{tag or digest}", content=manifest, headers={"Content-Type": OCI_MANIFEST}
        )
        r.raise_for_status()
    return f"{registry}/{repo}@{digest}"
