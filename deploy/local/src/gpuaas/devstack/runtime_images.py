"""The runtime images allocations run in on container hosts, built here from Debian packages.

No public image registry is reachable from this machine kind, so each image is a Debian 12 root
filesystem made by `mmdebstrap --variant=minbase --include=<packages> bookworm` from a recipe in
deploy/images/runtimes/<slug>.toml, with `gpuaas-init` (deploy/images/runtimes/gpuaas-init) baked in at
/usr/local/sbin, then `podman import`ed as `localhost/gpuaas/runtimes/<slug>:<version>` whose CMD idles.

Builds are cached by a hash of everything that shapes them (recipe, base recipe, init script, mirrors,
this module's build options): the root filesystem tar under ~/.cache/gpuaas/runtime-images/ and the
podman image (labelled with the hash). A second `ensure_images()` costs a `podman image inspect` per
image; with the tar but no image it is a `podman import` (seconds); only a changed recipe rebuilds.
Concurrent callers (parallel test sessions) serialise on a lock file per image.

    images = ensure_images()                       # build (or reuse) gpuaas-base and gpuaas-scipy
    pushed = push_images(images, "127.0.0.1:5000")  # {slug: PushedImage(ref=…@sha256:…, digest=…)}

`python -m gpuaas.devstack.runtime_images [build|push ADDRESS]` is `make runtime-images`.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("gpuaas.devstack")

REPO_ROOT = Path(__file__).resolve().parents[5]
RECIPES_DIR = REPO_ROOT / "deploy" / "images" / "runtimes"
INIT_SCRIPT = RECIPES_DIR / "gpuaas-init"
CONTAINERS_CONF = REPO_ROOT / "deploy" / "local" / "containers.conf"
CACHE_DIR = Path(os.environ.get("GPUAAS_RUNTIME_IMAGE_CACHE", Path.home() / ".cache" / "gpuaas" / "runtime-images"))
IMAGE_PREFIX = "localhost/gpuaas/runtimes"
REGISTRY_REPOSITORY = "runtimes"  # pushed as <registry>/runtimes/<slug>:<version>
DEFAULT_IMAGES = ("gpuaas-base", "gpuaas-scipy", "gpuaas-jupyter", "gpuaas-slurm")
INIT_PATH = "/usr/local/sbin/gpuaas-init"
PIP_VENV = "/opt/gpuaas/venv"  # where a recipe's `pip` requirements go (the Debian Python's own venv)
IDLE_CMD = [INIT_PATH, "--idle"]
HASH_LABEL = "gpuaas.recipe-hash"
TOOLS_PACKAGES = ("podman", "runc", "mmdebstrap", "uidmap")

SUITE = "bookworm"
MIRRORS = (
    f"deb http://deb.debian.org/debian {SUITE} main",
    f"deb http://deb.debian.org/debian {SUITE}-updates main",
    f"deb http://deb.debian.org/debian-security {SUITE}-security main",
)
# Smaller images: no recommends, no man pages, docs (copyright files kept) or translations.
APT_OPTIONS = ('APT::Install-Recommends "false"',)
DPKG_OPTIONS = (
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/locale/*",
)
BUILD_FORMAT = 1  # bump when the build below changes in a way the hash does not see


class ImageToolsMissing(RuntimeError):
    pass


@dataclass(frozen=True)
class Recipe:
    slug: str
    version: str
    display_name: str
    description: str
    runtime_version: str
    packages: tuple[str, ...]  # the base recipe's packages included
    exclude: tuple[str, ...]  # dpkg path-exclude globs of this recipe (and its base's)
    smoke: str  # a sh command that must succeed in the image (after gpuaas-init's own checks)
    pip: tuple[str, ...]  # PyPI requirements installed into PIP_VENV at build time (network access to PyPI)
    build_inputs: str  # canonical JSON of what shapes the image (base first; not `smoke`, not comments)
    app: dict[str, Any] | None = None  # a launchable app of the catalog that runs this image (seeded, not built)

    @property
    def recipe_hash(self) -> str:
        h = hashlib.sha256()
        for part in (
            str(BUILD_FORMAT),
            SUITE,
            *MIRRORS,
            *APT_OPTIONS,
            *DPKG_OPTIONS,
            self.build_inputs,
            INIT_SCRIPT.read_text(),
            json.dumps(IDLE_CMD),
        ):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    @property
    def local_ref(self) -> str:
        return f"{IMAGE_PREFIX}/{self.slug}:{self.version}"

    @property
    def tar_path(self) -> Path:
        return CACHE_DIR / f"{self.slug}-{self.version}-{self.recipe_hash[:16]}.tar"


@dataclass(frozen=True)
class BuiltImage:
    recipe: Recipe
    image_id: str
    size_bytes: int  # the podman image's size (uncompressed)
    built: str  # "cached" (image there), "imported" (tar there), "built" (mmdebstrap ran)
    seconds: float

    @property
    def slug(self) -> str:
        return self.recipe.slug

    @property
    def version(self) -> str:
        return self.recipe.version

    @property
    def local_ref(self) -> str:
        return self.recipe.local_ref


@dataclass(frozen=True)
class PushedImage:
    slug: str
    version: str
    tag_ref: str  # <registry>/runtimes/<slug>:<version>
    ref: str  # <registry>/runtimes/<slug>@sha256:<hex>: what the catalog pins
    digest: str


# ------------------------------------------------------------------------------------------- recipes


def load_recipe(slug: str, recipes_dir: Path = RECIPES_DIR) -> Recipe:
    path = recipes_dir / f"{slug}.toml"
    data = tomllib.loads(path.read_text())
    if data.get("slug") != slug:
        raise ValueError(f"{path}: slug {data.get('slug')!r} does not match the file name")
    packages = list(data.get("packages", []))
    exclude = [str(e) for e in data.get("exclude", [])]
    build_inputs = json.dumps({k: v for k, v in data.items() if k not in ("smoke", "app")}, sort_keys=True)
    if data.get("extends"):
        base = load_recipe(str(data["extends"]), recipes_dir)
        packages = [*base.packages, *[p for p in packages if p not in base.packages]]
        build_inputs = base.build_inputs + "\0" + build_inputs
        exclude = [*base.exclude, *exclude]
    return Recipe(
        slug=slug,
        version=str(data["version"]),
        display_name=str(data.get("display_name", slug)),
        description=str(data.get("description", "")),
        runtime_version=str(data.get("runtime_version", "")),
        packages=tuple(packages),
        exclude=tuple(exclude),
        smoke=str(data.get("smoke", "true")),
        pip=tuple(str(r) for r in data.get("pip", [])),
        app=data.get("app"),
        build_inputs=build_inputs,
    )


def podman_env() -> dict[str, str]:
    """The environment podman needs on this machine kind (runc, no default ulimits): the project's
    containers.conf unless the caller already points CONTAINERS_CONF elsewhere."""
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", str(CONTAINERS_CONF))
    return env


def podman_available() -> bool:
    return shutil.which("podman") is not None


def require_tools(*names: str) -> None:
    missing = [n for n in names if shutil.which(n) is None]
    if missing:
        raise ImageToolsMissing(
            f"{', '.join(missing)} not found: runtime images need "
            f"`apt-get install -y --no-install-recommends {' '.join(TOOLS_PACKAGES)}` (`make install` does it)"
        )


class Cancelled(RuntimeError):
    pass


class Jobs:
    """The subprocesses one caller's thread runs here, so that the caller can stop them (a stack stopped
    mid-build must leave no mmdebstrap or podman behind). `with jobs.installed():` in that thread."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self._procs: set[subprocess.Popen[str]] = set()
        self._lock = threading.Lock()

    @contextmanager
    def installed(self) -> Iterator[Jobs]:
        _current.jobs = self
        try:
            yield self
        finally:
            _current.jobs = None

    def run(self, cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
        with self._lock:
            if self.cancelled.is_set():
                raise Cancelled(f"cancelled before {cmd[0]}")
            proc = subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
            )
            self._procs.add(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        finally:
            with self._lock:
                self._procs.discard(proc)
        if self.cancelled.is_set():
            raise Cancelled(f"{cmd[0]} stopped")
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    def cancel(self, timeout_s: float = 10.0) -> None:
        """Stop what runs now (SIGTERM to its process group, then SIGKILL) and refuse what comes next."""
        self.cancelled.set()
        with self._lock:
            procs = list(self._procs)
        for proc in procs:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if proc.poll() is None:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)


_current = threading.local()


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    jobs: Jobs | None = getattr(_current, "jobs", None)
    if jobs is not None:
        return jobs.run(cmd, env, timeout)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def _podman(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    r = _run(["podman", *args], podman_env(), timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"podman {args[0]} failed ({r.returncode}): {r.stderr[-1000:]}")
    return r


# -------------------------------------------------------------------------------------------- build


@contextmanager
def _locked(name: str) -> Iterator[None]:
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _image_info(ref: str) -> dict[str, Any] | None:
    r = _podman("image", "inspect", ref, check=False)
    if r.returncode != 0:
        return None
    info = json.loads(r.stdout)
    return info[0] if info else None


def debian_rootfs(
    out: Path, packages: Iterable[str], *, exclude: Iterable[str] = (), hooks: Iterable[str] = (), what: str = ""
) -> None:
    """A Debian 12 minbase root filesystem tar with `packages` (no recommends, no docs: the options above),
    `exclude` dpkg path-exclude globs and extra mmdebstrap `hooks`. Also the base of the infrastructure images
    (gpuaas.devstack.infra_images)."""
    cmd = [
        "mmdebstrap",
        "--variant=minbase",
        "--quiet",
        f"--include={','.join(packages)}",
        *[f"--aptopt={o}" for o in APT_OPTIONS],
        *[f"--dpkgopt={o}" for o in DPKG_OPTIONS],
        *[f"--dpkgopt=path-exclude={e}" for e in exclude],
        *hooks,
        SUITE,
        str(out),
        *MIRRORS,
    ]
    env = {**os.environ, "SOURCE_DATE_EPOCH": "1700000000"}
    r = _run(cmd, env, 1800)
    if r.returncode != 0:
        raise RuntimeError(f"mmdebstrap failed for {what or out.name} ({r.returncode}): {r.stderr[-2000:]}")


def _mmdebstrap(recipe: Recipe, out: Path) -> None:
    marker = json.dumps({"slug": recipe.slug, "version": recipe.version, "recipe_hash": recipe.recipe_hash})
    hooks = [
        f"--customize-hook=copy-in {shlex.quote(str(INIT_SCRIPT))} /usr/local/sbin",
        f'--customize-hook=chmod 0755 "$1{INIT_PATH}"',
        f'--customize-hook=printf "%s\\n" {shlex.quote(marker)} > "$1/etc/gpuaas-runtime.json"',
        *_pip_hooks(recipe),
    ]
    debian_rootfs(out, recipe.packages, exclude=recipe.exclude, hooks=hooks, what=recipe.slug)


def _pip_hooks(recipe: Recipe) -> list[str]:
    """A venv with the recipe's PyPI requirements (pinned in the recipe), made inside the image's root with
    its own Python (pip's cache left out). PyPI must be reachable at build time. pip trusts the BUILD host's
    CA bundle for the build only (a TLS-inspecting proxy's CA is often only there), copied in and removed
    after; the build host's pip settings (find-links, config files) are not used."""
    if not recipe.pip:
        return []
    reqs = " ".join(shlex.quote(r) for r in recipe.pip)
    ca = "/etc/gpuaas-build-ca.crt"  # not /tmp: a hook's chroot may get a fresh /tmp
    host_ca = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt"
    proxies = " ".join(
        f"{k}={shlex.quote(v)}" for k, v in os.environ.items() if k.lower() in ("http_proxy", "https_proxy", "no_proxy")
    )
    # A clean environment: the build host's CA/pip variables name ITS paths, which mean other files in the chroot.
    script = (
        f"python3 -m venv {PIP_VENV} && env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 {proxies} "
        f"PIP_CERT={ca} SSL_CERT_FILE={ca} REQUESTS_CA_BUNDLE={ca} PIP_CONFIG_FILE=/dev/null "
        f"PIP_DISABLE_PIP_VERSION_CHECK=1 {PIP_VENV}/bin/pip install --quiet --no-cache-dir --only-binary=:all: {reqs}"
    )
    return [
        f'--customize-hook=cp {shlex.quote(host_ca)} "$1{ca}"',
        f'--customize-hook=chroot "$1" sh -c {shlex.quote(script)}',
        f'--customize-hook=rm -f "$1{ca}"',
    ]


def _import(recipe: Recipe) -> None:
    labels = {
        HASH_LABEL: recipe.recipe_hash,
        "org.opencontainers.image.title": recipe.slug,
        "org.opencontainers.image.version": recipe.version,
        "org.opencontainers.image.description": recipe.description,
    }
    changes = [f"CMD {json.dumps(IDLE_CMD)}", "ENV LANG=C.UTF-8", "WORKDIR /"]
    changes += [f"LABEL {k}={json.dumps(v)}" for k, v in labels.items()]
    args = [a for c in changes for a in ("--change", c)]
    _podman("import", *args, "--message", f"{recipe.slug} {recipe.version}", str(recipe.tar_path), recipe.local_ref)


def ensure_image(recipe: Recipe, *, rebuild: bool = False) -> BuiltImage:
    """The image for `recipe` in podman's storage, built or imported only when its hash is not there."""
    require_tools("podman")
    t0 = time.monotonic()
    with _locked(recipe.slug):
        info = None if rebuild else _image_info(recipe.local_ref)
        labels = (info or {}).get("Labels") or (info or {}).get("Config", {}).get("Labels") or {}
        how = "cached"
        if info is None or labels.get(HASH_LABEL) != recipe.recipe_hash:
            if rebuild or not recipe.tar_path.exists():
                require_tools("mmdebstrap")
                log.info("building runtime image %s (mmdebstrap, a minute or more)", recipe.local_ref)
                with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
                    out = Path(tmp) / "rootfs.tar"
                    _mmdebstrap(recipe, out)
                    out.replace(recipe.tar_path)
                for stale in CACHE_DIR.glob(f"{recipe.slug}-*.tar"):
                    if stale != recipe.tar_path:
                        stale.unlink(missing_ok=True)
                how = "built"
            else:
                how = "imported"
            _import(recipe)
            info = _image_info(recipe.local_ref)
            if info is None:
                raise RuntimeError(f"podman import did not produce {recipe.local_ref}")
    return BuiltImage(recipe, str(info["Id"]), int(info.get("Size", 0)), how, time.monotonic() - t0)


def ensure_images(slugs: Iterable[str] = DEFAULT_IMAGES, *, rebuild: bool = False) -> list[BuiltImage]:
    return [ensure_image(load_recipe(s), rebuild=rebuild) for s in slugs]


def smoke_test(image: BuiltImage, timeout_s: float = 300) -> str:  # a loaded 2-core machine: ~25 s for jupyter
    """Run the image once: gpuaas-init creates a user (twice: idempotent) whose sudo works, then the
    recipe's smoke command. Returns its output; raises RuntimeError when anything fails."""
    user, uid = "gpuaas-smoke", "4242"
    script = (
        f"{INIT_PATH} {user} {uid} && {INIT_PATH} {user} {uid} && "
        f'test "$(sudo -u {user} sudo -n id -u)" = 0 && test "$(id -u {user})" = {uid} && '
        f"{image.recipe.smoke}"
    )
    r = _podman("run", "--rm", "--network=none", image.local_ref, "sh", "-c", script, check=False, timeout=timeout_s)
    if r.returncode != 0:
        raise RuntimeError(f"smoke test of {image.local_ref} failed ({r.returncode}): {(r.stderr or r.stdout)[-1000:]}")
    return r.stdout.strip()


# --------------------------------------------------------------------------------------------- push


def push_image(image: BuiltImage, registry: str) -> PushedImage:
    """Push to `<registry>/runtimes/<slug>:<version>` (plain HTTP: a loopback registry) and return the
    digest-pinned reference the catalog registers and the agents pull."""
    tag_ref = f"{registry}/{REGISTRY_REPOSITORY}/{image.slug}:{image.version}"
    with tempfile.TemporaryDirectory() as tmp:
        digestfile = Path(tmp) / "digest"
        _podman("push", "--quiet", "--tls-verify=false", "--digestfile", str(digestfile), image.local_ref, tag_ref)
        digest = digestfile.read_text().strip()
    if not digest.startswith("sha256:"):
        raise RuntimeError(f"podman push of {tag_ref} gave no digest ({digest!r})")
    ref = f"{registry}/{REGISTRY_REPOSITORY}/{image.slug}@{digest}"
    return PushedImage(image.slug, image.version, tag_ref, ref, digest)


def push_images(images: Iterable[BuiltImage], registry: str) -> dict[str, PushedImage]:
    return {image.slug: push_image(image, registry) for image in images}


# A registry's storage holds no address, and pushes of the same podman image give the same digests, so a
# fresh registry (each test session has one) gets a copy of a registry the images were pushed to once:
# ~1 s instead of ~35 s of gzip for the two images. Copies, not hard links: tamper tests overwrite blobs.


def _storage_cache(images: Iterable[BuiltImage]) -> Path:
    key = hashlib.sha256("\0".join(sorted(f"{i.slug}:{i.version}:{i.image_id}" for i in images)).encode())
    return CACHE_DIR / f"registry-{key.hexdigest()[:16]}"


def restore_registry(images: list[BuiltImage], storage: Path, registry: str) -> dict[str, PushedImage] | None:
    """Fill `storage` (a registry's filesystem root) from the cached copy, files it lacks only; None when
    there is no cached copy of these images."""
    cached = _storage_cache(images)
    with _locked("registry"):
        try:
            digests = json.loads((cached / "pushed.json").read_text())
        except (OSError, ValueError):
            return None
        src_root = cached / "storage"
        for src_dir, _dirs, files in os.walk(src_root):
            dest_dir = storage / Path(src_dir).relative_to(src_root)
            dest_dir.mkdir(parents=True, exist_ok=True)
            for name in files:
                if not (dest_dir / name).exists():
                    shutil.copy2(Path(src_dir) / name, dest_dir / name)
    return {
        i.slug: PushedImage(
            i.slug,
            i.version,
            f"{registry}/{REGISTRY_REPOSITORY}/{i.slug}:{i.version}",
            f"{registry}/{REGISTRY_REPOSITORY}/{i.slug}@{digests[i.slug]}",
            digests[i.slug],
        )
        for i in images
    }


def save_registry(images: list[BuiltImage], storage: Path, pushed: dict[str, PushedImage]) -> None:
    """Keep a copy of `storage` right after the push, for restore_registry (older copies are removed)."""
    cached = _storage_cache(images)
    with _locked("registry"):
        if (cached / "pushed.json").exists():
            return
        for stale in CACHE_DIR.glob("registry-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=CACHE_DIR, prefix=".registry-"))
        shutil.copytree(storage, tmp / "storage")
        (tmp / "pushed.json").write_text(json.dumps({slug: p.digest for slug, p in pushed.items()}))
        tmp.rename(cached)


def publish(images: list[BuiltImage], storage: Path, registry: str) -> dict[str, PushedImage]:
    """The images in the registry at `registry` whose filesystem root is `storage`: restored from the
    cached copy when there is one, else pushed (and the copy kept)."""
    pushed = restore_registry(images, storage, registry)
    if pushed is None:
        pushed = push_images(images, registry)
        save_registry(images, storage, pushed)
    return pushed


# ---------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpuaas.devstack.runtime_images", description=(__doc__ or "").split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command")
    build = sub.add_parser("build", help="build (or reuse) the runtime images; print what was done")
    build.add_argument("--rebuild", action="store_true", help="ignore the cache: run mmdebstrap again")
    build.add_argument("slugs", nargs="*", default=list(DEFAULT_IMAGES))
    push = sub.add_parser("push", help="build (cached) and push to a registry (host:port, plain HTTP)")
    push.add_argument("registry")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s %(message)s", datefmt="%H:%M:%S")
    try:
        images = ensure_images(getattr(args, "slugs", None) or DEFAULT_IMAGES, rebuild=getattr(args, "rebuild", False))
    except ImageToolsMissing as exc:
        print(exc, file=sys.stderr)
        return 1
    for im in images:
        print(
            f"{im.local_ref:<48} {im.built:<8} {im.seconds:6.1f}s  {im.size_bytes / 1e6:6.1f} MB  "
            f"recipe {im.recipe.recipe_hash[:12]}"
        )
    if args.command == "push":
        for slug, p in push_images(images, args.registry).items():
            print(f"{slug}: {p.ref}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
