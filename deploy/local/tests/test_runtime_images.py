"""The runtime images with real podman and a real registry: recipe hashing, the build cache, gpuaas-init
inside the image, the idle main process, publishing to a registry (cached copy, same digests) and a pull
refusing tampered content. The first run builds the images (~2 min, mmdebstrap); later runs reuse them."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpuaas.devstack import runtime_images as ri
from gpuaas.devstack.config import StackConfig
from gpuaas.devstack.infra import free_port
from gpuaas.devstack.registry import LocalRegistry, RegistryMissing
from gpuaas.devstack.runtimes import LocalRuntimes, runtimes_wanted

needs_podman = pytest.mark.skipif(
    shutil.which("podman") is None or shutil.which("mmdebstrap") is None,
    reason="podman and mmdebstrap are needed (make install)",
)
MANIFEST_TYPES = "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json"


def podman(*args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], env=ri.podman_env(), capture_output=True, text=True, check=check)


# ------------------------------------------------------------------------------------- recipes (no I/O)


def _recipes(tmp_path: Path, base_packages: list[str]) -> Path:
    tmp_path.mkdir()
    (tmp_path / "a.toml").write_text(f'slug = "a"\nversion = "1.0.0"\npackages = {json.dumps(base_packages)}\n')
    (tmp_path / "b.toml").write_text(
        'slug = "b"\nversion = "2.0.0"\nextends = "a"\nsmoke = "true"\npackages = ["python3-numpy", "bash"]\n'
    )
    return tmp_path


def test_recipe_extends_its_base_and_hashes_what_shapes_the_image(tmp_path: Path) -> None:
    b = ri.load_recipe("b", _recipes(tmp_path / "1", ["bash", "sudo"]))
    assert b.packages == ("bash", "sudo", "python3-numpy")
    assert b.version == "2.0.0" and b.local_ref == "localhost/gpuaas/runtimes/b:2.0.0"
    other_base = ri.load_recipe("b", _recipes(tmp_path / "2", ["bash", "sudo", "less"]))
    assert other_base.recipe_hash != b.recipe_hash  # a base package changed: b is rebuilt too
    (tmp_path / "2" / "b.toml").write_text(
        (tmp_path / "2" / "b.toml").read_text().replace('smoke = "true"', 'smoke = "python3 -V"') + "# a comment\n"
    )
    assert ri.load_recipe("b", tmp_path / "2").recipe_hash == other_base.recipe_hash  # smoke/comments: no rebuild


def test_shipped_recipes() -> None:
    base, scipy, jupyter, slurm = (ri.load_recipe(s) for s in ri.DEFAULT_IMAGES)
    assert {"bash", "sudo", "python3", "procps", "passwd", "ca-certificates"} <= set(base.packages)
    for extended in (scipy, jupyter, slurm):  # each extends the base image
        assert set(base.packages) < set(extended.packages), extended.slug
    assert {"python3-numpy", "python3-scipy", "jupyter-notebook"} <= set(scipy.packages)
    assert any(r.startswith("jupyterlab==") for r in jupyter.pip)  # pinned: the recipe hash follows it
    assert {"slurm-wlm", "munge"} <= set(slurm.packages)
    assert (base.version, scipy.version) == ("1.0.0", "1.0.0")


def test_runtimes_are_off_when_asked_or_without_the_catalog() -> None:
    assert not runtimes_wanted(StackConfig(runtime_images=False), ("catalog", "identity"))
    assert not runtimes_wanted(StackConfig(), ("identity",))
    assert not runtimes_wanted(StackConfig(agent_driver="process"), ("catalog", "identity"))
    assert StackConfig.from_env({"GPUAAS_STACK_RUNTIME_IMAGES": "0"}).runtime_images is False
    assert StackConfig.from_env({"GPUAAS_STACK_AGENT_DRIVER": "process"}).agent_driver == "process"


# --------------------------------------------------------------------------------------- real podman


@pytest.fixture(scope="module")
def images() -> list[ri.BuiltImage]:
    if shutil.which("podman") is None or shutil.which("mmdebstrap") is None:
        pytest.skip("podman and mmdebstrap are needed (make install)")
    return ri.ensure_images()


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRegistry]:
    try:
        reg = LocalRegistry(tmp_path_factory.mktemp("registry")).start()
    except RegistryMissing as exc:
        pytest.skip(str(exc))
    yield reg
    reg.stop()


@needs_podman
def test_a_second_build_is_the_cached_image(images: list[ri.BuiltImage]) -> None:
    t0 = time.monotonic()
    again = ri.ensure_images()
    assert time.monotonic() - t0 < 10
    assert [i.built for i in again] == ["cached"] * len(ri.DEFAULT_IMAGES)
    assert [i.image_id for i in again] == [i.image_id for i in images]
    info = json.loads(podman("image", "inspect", again[0].local_ref, check=True).stdout)[0]
    assert info["Config"]["Cmd"] == ri.IDLE_CMD
    assert info["Config"]["Labels"][ri.HASH_LABEL] == again[0].recipe.recipe_hash


@needs_podman
def test_gpuaas_init_creates_the_user_idempotently_and_refuses_bad_input(images: list[ri.BuiltImage]) -> None:
    script = """
        set -e
        gpuaas-init alice 1234
        gpuaas-init alice 1234
        id -u alice; id -g alice; stat -c '%a %U' /home/alice; getent passwd alice | cut -d: -f7
        sudo -u alice sudo -n id -u
        sudo -u alice cat /etc/shadow >/dev/null 2>&1 && echo shadow-readable || echo shadow-refused
        for bad in 'root 1234' 'alice 4321' 'bob 1234' 'bob 999' 'bob 0' 'Bob 2000' 'b;b 2000' 'bob'; do
            gpuaas-init $bad >/dev/null 2>&1 && echo "accepted $bad" || echo "refused $bad"
        done
    """
    r = podman("run", "--rm", "--network=none", images[0].local_ref, "sh", "-c", script)
    assert r.returncode == 0, r.stderr
    out = r.stdout.split("\n")
    assert out[:6] == ["1234", "1234", "700 alice", "/bin/bash", "0", "shadow-refused"]
    assert all(line.startswith("refused ") for line in out[6:14]), out[6:14]


@needs_podman
def test_the_main_process_idles_and_stops_at_once(images: list[ri.BuiltImage]) -> None:
    r = podman("run", "-d", "--rm", images[0].local_ref, check=True)
    cid = r.stdout.strip()
    try:
        time.sleep(0.3)
        assert podman("inspect", "-f", "{{.State.Running}}", cid).stdout.strip() == "true"
        t0 = time.monotonic()
        podman("stop", "-t", "10", cid, check=True)
        assert time.monotonic() - t0 < 3  # SIGTERM ends it: no 10 s wait for the kill
    finally:
        podman("rm", "-f", "--ignore", cid)


@needs_podman
def test_smoke_tests_pass(images: list[ri.BuiltImage]) -> None:
    assert "OpenSSL" in ri.smoke_test(images[0])
    assert ri.smoke_test(images[1]).startswith("1.")  # numpy's version


@needs_podman
def test_publish_gives_stable_digests_and_a_pull_refuses_tampered_content(
    images: list[ri.BuiltImage], registry: LocalRegistry, tmp_path: Path
) -> None:
    pushed = ri.publish(images, registry.storage, registry.address)
    assert set(pushed) == set(ri.DEFAULT_IMAGES)
    base = pushed["gpuaas-base"]
    assert base.ref == f"{registry.address}/runtimes/gpuaas-base@{base.digest}"
    r = httpx.head(f"{registry.url}/v2/runtimes/gpuaas-base/manifests/1.0.0", headers={"Accept": MANIFEST_TYPES})
    assert r.headers["Docker-Content-Digest"] == base.digest
    # A second, fresh registry gets the same content from the cached copy: same digests.
    other = LocalRegistry(tmp_path / "other").start()
    try:
        again = ri.publish(images, other.storage, other.address)
        assert {s: p.digest for s, p in again.items()} == {s: p.digest for s, p in pushed.items()}
        assert podman("pull", "-q", "--tls-verify=false", again["gpuaas-base"].ref).returncode == 0
        # Tamper with the image configuration in the registry: podman refuses what does not match the digest.
        manifest = httpx.get(
            f"{other.url}/v2/runtimes/gpuaas-base/manifests/{base.digest}", headers={"Accept": MANIFEST_TYPES}
        ).json()
        other.blob_path(manifest["config"]["digest"]).write_bytes(b'{"os": "linux", "evil": true}')
        r = podman("pull", "-q", "--tls-verify=false", again["gpuaas-base"].ref)
        assert r.returncode != 0 and "does not match" in r.stderr, r.stderr
    finally:
        other.stop()
    # The cached copy was not touched by the tampering (copies, not links).
    third = LocalRegistry(tmp_path / "third").start()
    try:
        ri.publish(images, third.storage, third.address)
        assert (
            podman("pull", "-q", "--tls-verify=false", f"{third.address}/runtimes/gpuaas-base@{base.digest}").returncode
            == 0
        )
    finally:
        third.stop()


@needs_podman
def test_local_runtimes_without_a_catalog_give_the_agents_the_container_driver(tmp_path: Path) -> None:
    runtimes = LocalRuntimes(True, tmp_path, free_port(), credentials=None, service_url=str)
    runtimes.start()
    try:
        assert runtimes.wait(600)
        env = runtimes.agent_env()
        assert env["GPUAAS_AGENT_DRIVER"] == "container"
        assert Path(env["GPUAAS_AGENT_CONTAINERS_CONF"]).read_text().count('runtime = "runc"') == 1
        state = runtimes.state()
        assert state is not None and set(state["images"]) == set(ri.DEFAULT_IMAGES) and state["pid"]
    finally:
        runtimes.stop()
    assert LocalRuntimes(False, tmp_path, 1, None, str).agent_env() == {"GPUAAS_AGENT_DRIVER": "process"}
