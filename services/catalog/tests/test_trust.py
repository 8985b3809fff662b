"""Artifact trust against a real registry (docker-registry on loopback): digest pinning, content
verification by hashing, tampering, skopeo/umoci-built images, blob artifacts, cosign signatures."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import uuid

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from gpuaas.catalog.oci import ACCEPT, TrustError, digest_of, parse_ref
from gpuaas.devstack.registry import require_tools

pytestmark = pytest.mark.integration


def test_refs_must_be_pinned_by_digest() -> None:
    digest = "sha256:" + "a" * 64
    ref = parse_ref(f"127.0.0.1:5000/apps/x@{digest}")
    assert (ref.registry, ref.repository, ref.digest) == ("127.0.0.1:5000", "apps/x", digest)
    cases = {
        "127.0.0.1:5000/apps/x:v1": "artifact_ref_not_pinned",
        "127.0.0.1:5000/apps/x": "artifact_ref_not_pinned",
        "127.0.0.1:5000/apps/x@sha256:abc": "artifact_ref_invalid_digest",
        f"apps/x@{digest}": "artifact_ref_no_registry",
        f"127.0.0.1:5000/apps/x:v1@{digest}": "artifact_ref_invalid",
        f"127.0.0.1:5000/Apps/X@{digest}": "artifact_ref_invalid",
    }
    for bad, code in cases.items():
        with pytest.raises(TrustError) as err:
            parse_ref(bad)
        assert err.value.code == code, bad
    with pytest.raises(TrustError) as err:
        parse_ref("127.0.0.1:5000/apps/x:v1")
    assert "'v1'" in err.value.detail and "pin it" not in err.value.detail  # names the tag, says what to do


async def test_register_verifies_content_and_refuses_wrong_missing_and_tampered(world, flows, registry) -> None:
    c, op = world.client, world.op
    ref = await flows.image()
    art = await flows.register(ref.ref)
    assert art["state"] == "draft" and art["digest"] == ref.digest and art["kind"] == "oci"
    assert art["size_bytes"] > 0 and art["media_type"] == "application/vnd.oci.image.manifest.v1+json"
    assert [ch["name"] for ch in art["checks"]] == ["content"] and art["checks"][0]["passed"]

    again = await c.post("/artifacts", json={"ref": ref.ref}, headers=op)
    assert again.status_code == 409 and again.json()["code"] == "artifact_already_registered"

    tag = await c.post("/artifacts", json={"ref": f"{registry.address}/{ref.repository}:v1"}, headers=op)
    assert tag.status_code == 422 and tag.json()["code"] == "artifact_ref_not_pinned"
    assert "digest" in tag.json()["detail"]

    wrong = await c.post(
        "/artifacts", json={"ref": f"{registry.address}/{ref.repository}@sha256:{'0' * 64}"}, headers=op
    )
    assert wrong.status_code == 422 and wrong.json()["code"] == "artifact_manifest_unknown"

    missing_repo = await c.post("/artifacts", json={"ref": f"{registry.address}/nope/none@{ref.digest}"}, headers=op)
    assert missing_repo.status_code == 422 and missing_repo.json()["code"] == "artifact_manifest_unknown"

    # Tampered: overwrite the layer in the registry's storage; the registry still serves it under the old digest.
    bad = await flows.image()
    async with httpx.AsyncClient(base_url=registry.url) as h:
        manifest = (await h.get(f"/v2/{bad.repository}/manifests/{bad.digest}", headers={"Accept": ACCEPT})).json()
        layer = manifest["layers"][0]["digest"]
        registry.blob_file(layer).write_bytes(b"evil" * 10)
        served = await h.get(f"/v2/{bad.repository}/blobs/{layer}")
        assert served.status_code == 200 and digest_of(served.content) != layer  # the registry did not notice
    tampered = await c.post("/artifacts", json={"ref": bad.ref}, headers=op)
    assert tampered.status_code == 422 and tampered.json()["code"] == "artifact_content_tampered"
    assert layer in tampered.json()["detail"]

    # Nothing was written for the refused ones.
    listed = await c.get("/artifacts", headers=op)
    refs = {a["ref"] for a in listed.json()}
    assert ref.ref in refs and bad.ref not in refs

    unreachable = await c.post("/artifacts", json={"ref": f"127.0.0.1:1/apps/x@{ref.digest}"}, headers=op)
    assert unreachable.status_code == 503 and unreachable.json()["code"] == "registry_unreachable"


async def test_only_operators_register_and_promote(world, flows) -> None:
    ref = await flows.image()
    r = await world.client.post("/artifacts", json={"ref": ref.ref}, headers=world.headers(world.t1_admin))
    assert r.status_code == 403 and r.json()["code"] == "permission_denied"
    r = await world.client.post("/artifacts", json={"ref": ref.ref})
    assert r.status_code == 401
    art = await flows.register(ref.ref)
    r = await world.client.post(
        f"/artifacts/{art['artifact_id']}/checks",
        json={"name": "lint", "passed": True},
        headers=world.headers(world.t1_admin),
    )
    assert r.status_code == 403
    r = await world.client.get("/artifacts", headers=world.headers(world.t1_member))
    assert r.status_code == 403


async def test_image_built_with_umoci_and_pushed_with_skopeo(world, flows, registry, tmp_path) -> None:
    tools = require_tools("umoci", "skopeo")
    layout = tmp_path / "img"

    def run(*args: str) -> None:
        subprocess.run(args, check=True, capture_output=True, timeout=60)

    def build_and_push() -> None:
        run(tools["umoci"], "init", "--layout", str(layout))
        run(tools["umoci"], "new", "--image", f"{layout}:v1")
        run(tools["umoci"], "config", "--image", f"{layout}:v1", "--config.label", f"run={uuid.uuid4()}")
        run(
            tools["skopeo"],
            "copy",
            "--dest-tls-verify=false",
            f"oci:{layout}:v1",
            f"docker://{registry.address}/tools/umoci-img:v1",
        )

    await asyncio.to_thread(build_and_push)
    async with httpx.AsyncClient(base_url=registry.url) as h:
        head = await h.head("/v2/tools/umoci-img/manifests/v1", headers={"Accept": ACCEPT})
        digest = head.headers["docker-content-digest"]
    art = await flows.register(f"{registry.address}/tools/umoci-img@{digest}")
    assert art["digest"] == digest and art["checks"][0]["passed"]
    assert shutil.which("skopeo")


async def test_blob_artifacts_as_oci_artifact_and_raw_blob(world, flows, registry, oci) -> None:
    weights = b"\x00\x01fake-weights" * 1000
    ref = await oci.push_blob_artifact(
        registry.address, "models/tiny", weights, artifact_type="application/vnd.gpuaas.model.v1", filename="w.bin"
    )
    art = await flows.register(ref.ref, kind="blob")
    assert art["kind"] == "blob" and art["artifact_type"] == "application/vnd.gpuaas.model.v1"
    assert art["size_bytes"] >= len(weights)

    script = b"#!/bin/sh\necho train " + uuid.uuid4().hex.encode() + b"\n"
    blob_digest = await oci.push_blob(registry.address, "scripts/train", script)
    raw = await flows.register(f"{registry.address}/scripts/train@{blob_digest}", kind="blob")
    assert raw["size_bytes"] == len(script)
    # An OCI artifact must name a manifest: a raw blob is not an image.
    other = await oci.push_blob(registry.address, "scripts/train", script + b"#")
    r = await world.client.post(
        "/artifacts", json={"ref": f"{registry.address}/scripts/train@{other}", "kind": "oci"}, headers=world.op
    )
    assert r.status_code == 422 and r.json()["code"] == "artifact_not_a_manifest"
    registry.blob_file(blob_digest).write_bytes(b"#!/bin/sh\nrm -rf /\n")
    verify = await world.client.post(f"/artifacts/{raw['artifact_id']}/verify", headers=world.op)
    assert verify.status_code == 200 and verify.json()["passed"] is False
    assert verify.json()["code"] == "artifact_content_tampered"
    content = [ch for ch in verify.json()["artifact"]["checks"] if ch["name"] == "content"]
    assert content == [content[0]] and content[0]["passed"] is False


async def test_cosign_key_pair_signatures(world, flows, oci) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    pem = (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    other = (
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )

    unsigned = await flows.image()
    r = await world.client.post("/artifacts", json={"ref": unsigned.ref, "public_key": pem}, headers=world.op)
    assert r.status_code == 422 and r.json()["code"] == "signature_invalid"

    signed = await flows.image()
    await oci.push_cosign_signature(signed, key)
    r = await world.client.post("/artifacts", json={"ref": signed.ref, "public_key": other}, headers=world.op)
    assert r.status_code == 422 and r.json()["code"] == "signature_invalid"
    r = await world.client.post("/artifacts", json={"ref": signed.ref, "public_key": "not a key"}, headers=world.op)
    assert r.status_code == 422 and r.json()["code"] == "signature_key_invalid"
    art = await flows.register(signed.ref, public_key=pem)
    assert art["signature_verified"] is True
    assert {c["name"]: c["passed"] for c in art["checks"]} == {"content": True, "signature": True}
    # The signature payload names the digest: a signature of one image does not vouch for another.
    sig_manifest_tag = signed.digest.replace(":", "-") + ".sig"
    async with httpx.AsyncClient(base_url=f"http://{signed.registry}") as h:
        body = (await h.get(f"/v2/{signed.repository}/manifests/{sig_manifest_tag}", headers={"Accept": ACCEPT})).json()
    assert json.dumps(body).count("dev.cosignproject.cosign/signature") == 1
