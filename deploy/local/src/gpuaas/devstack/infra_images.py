"""The infrastructure images (Apache Kafka, Postgres) of the compose deployment and of the e2e suite on
testcontainers, built here from Debian packages: no public image registry is reachable.

Two steps per image (deploy/images/infra/README.md has the tags and the environment contract):

1. a base: a Debian 12 minbase root filesystem with the image's packages (`runtime_images.debian_rootfs`:
   mmdebstrap with the runtime images' options), `podman import`ed as `localhost/gpuaas-base-jre:17` /
   `localhost/gpuaas-base-postgres:15`;
2. `podman build --build-arg BASE=<base>` of deploy/images/infra/<name>/Containerfile (the Kafka context also
   gets `libs/`: the broker's jars from `gpuaas.devstack.kafka.ensure_jars`, the version the process-run broker
   runs) tagged `localhost/gpuaas-kafka:<version>` / `localhost/gpuaas-postgres:15`.

Both are cached by a hash of what shapes them, kept in a label: a second `ensure_infra_images()` costs a
`podman image inspect` per image; the base's tar is kept in ~/.cache/gpuaas/infra-images, so a lost base image is
a `podman import` (seconds), not a new mmdebstrap.

`python -m gpuaas.devstack.infra_images build [--rebuild]` is `make infra-images`: it prints each image's size.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gpuaas.devstack import runtime_images as ri
from gpuaas.devstack.kafka import KAFKA_VERSION, ensure_jars

log = logging.getLogger("gpuaas.devstack")

INFRA_DIR = ri.REPO_ROOT / "deploy" / "images" / "infra"
CACHE_DIR = Path(os.environ.get("GPUAAS_INFRA_IMAGE_CACHE", Path.home() / ".cache" / "gpuaas" / "infra-images"))
HASH_LABEL = "gpuaas.build-hash"
BUILD_FORMAT = 1  # bump when the build below changes in a way the hashes do not see
KAFKA_IMAGE = f"localhost/gpuaas-kafka:{KAFKA_VERSION}"
POSTGRES_IMAGE = "localhost/gpuaas-postgres:15"


@dataclass(frozen=True)
class Base:
    ref: str
    packages: tuple[str, ...]
    hooks: tuple[str, ...] = ()  # extra mmdebstrap hooks
    exclude: tuple[str, ...] = ()  # dpkg path-exclude globs

    @property
    def build_hash(self) -> str:
        parts = (
            str(BUILD_FORMAT),
            ri.SUITE,
            *ri.MIRRORS,
            *ri.APT_OPTIONS,
            *ri.DPKG_OPTIONS,
            *self.packages,
            *self.hooks,
            *self.exclude,
        )
        return _sha256(parts)

    @property
    def tar_path(self) -> Path:
        name = self.ref.rsplit("/", 1)[-1].replace(":", "-")
        return CACHE_DIR / f"{name}-{self.build_hash[:16]}.tar"


@dataclass(frozen=True)
class InfraImage:
    name: str  # its directory under deploy/images/infra
    ref: str
    base: Base
    version: str
    with_kafka_jars: bool = False

    @property
    def context_dir(self) -> Path:
        return INFRA_DIR / self.name


@dataclass(frozen=True)
class BuiltImage:
    ref: str
    image_id: str
    size_bytes: int
    built: str  # "cached" (label matched), "built" (podman build ran)
    seconds: float


# openjdk's postinst links its man pages with update-alternatives, which fails when the man directory (excluded
# from the image) does not exist.
JRE_BASE = Base(
    "localhost/gpuaas-base-jre:17",
    ("bash", "ca-certificates", "openjdk-17-jre-headless"),
    ('--essential-hook=mkdir -p "$1/usr/share/man/man1"',),
)
# Debian's postgresql-15 creates a cluster "main" on install: the image's entrypoint makes its own in PGDATA.
# Without LLVM (its library, z3 and the JIT's bitcode: ~155 of 376 MB) Postgres runs without JIT compilation
# (it finds no llvmjit.so and plans as with jit=off), which OLTP queries like the platform's do not need.
POSTGRES_BASE = Base(
    "localhost/gpuaas-base-postgres:15",
    ("bash", "postgresql-15"),
    ('--customize-hook=chroot "$1" pg_dropcluster 15 main',),
    (
        "/usr/lib/*/libLLVM-14.so*",
        "/usr/lib/*/libz3.so*",
        "/usr/lib/postgresql/15/lib/bitcode/*",
        "/usr/lib/postgresql/15/lib/llvmjit*",
    ),
)
IMAGES = {
    "kafka": InfraImage("kafka", KAFKA_IMAGE, JRE_BASE, KAFKA_VERSION, with_kafka_jars=True),
    "postgres": InfraImage("postgres", POSTGRES_IMAGE, POSTGRES_BASE, "15"),
}


def _sha256(parts: tuple[str, ...] | list[str]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _labels(info: dict | None) -> dict[str, str]:
    if not info:
        return {}
    return info.get("Labels") or info.get("Config", {}).get("Labels") or {}


def ensure_base(base: Base, *, rebuild: bool = False) -> str:
    """The base image's id: from podman's storage when its hash label matches, else imported from the cached
    tar, else built with mmdebstrap (a minute or two)."""
    ri.require_tools("podman")
    info = None if rebuild else ri._image_info(base.ref)
    if info is not None and _labels(info).get(HASH_LABEL) == base.build_hash:
        return str(info["Id"])
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    if rebuild or not base.tar_path.exists():
        ri.require_tools("mmdebstrap")
        log.info("building %s from Debian packages (mmdebstrap)", base.ref)
        with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
            out = Path(tmp) / "rootfs.tar"
            ri.debian_rootfs(out, base.packages, exclude=base.exclude, hooks=base.hooks, what=base.ref)
            out.replace(base.tar_path)
        prefix = base.tar_path.name.rsplit("-", 1)[0]
        for stale in CACHE_DIR.glob(f"{prefix}-*.tar"):
            if stale != base.tar_path:
                stale.unlink(missing_ok=True)
    changes = ['CMD ["/bin/bash"]', "ENV LANG=C.UTF-8", f"LABEL {HASH_LABEL}={base.build_hash}"]
    ri._podman("import", *[a for c in changes for a in ("--change", c)], str(base.tar_path), base.ref)
    info = ri._image_info(base.ref)
    if info is None:
        raise RuntimeError(f"podman import did not produce {base.ref}")
    return str(info["Id"])


def _context_files(image: InfraImage) -> list[Path]:
    return sorted(p for p in image.context_dir.iterdir() if p.is_file() and p.name != "README.md")


def _jars(image: InfraImage) -> list[Path]:
    return sorted(ensure_jars(image.version).glob("*.jar")) if image.with_kafka_jars else []


def image_hash(image: InfraImage, base_id: str) -> str:
    parts = [str(BUILD_FORMAT), image.ref, base_id]
    for f in _context_files(image):
        parts += [f.name, f.read_text(), oct(f.stat().st_mode & 0o111)]
    parts += [f"{j.name}:{j.stat().st_size}" for j in _jars(image)]
    return _sha256(parts)


def _revision() -> str:
    r = subprocess.run(["git", "-C", str(ri.REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else "unknown"


def ensure_image(image: InfraImage, *, rebuild: bool = False) -> BuiltImage:
    """The image in podman's storage, built only when its hash (base, context files, jars) changed."""
    t0 = time.monotonic()
    with ri._locked(f"infra-{image.name}"):
        base_id = ensure_base(image.base, rebuild=rebuild)
        wanted = image_hash(image, base_id)
        info = None if rebuild else ri._image_info(image.ref)
        how = "cached"
        if info is None or _labels(info).get(HASH_LABEL) != wanted:
            with tempfile.TemporaryDirectory(dir=CACHE_DIR, prefix=f".context-{image.name}-") as tmp:
                context = Path(tmp)
                for f in _context_files(image):
                    shutil.copy2(f, context / f.name)
                if image.with_kafka_jars:
                    (context / "libs").mkdir()
                    for jar in _jars(image):
                        shutil.copy2(jar, context / "libs" / jar.name)
                log.info("building %s (podman build FROM %s)", image.ref, image.base.ref)
                ri._podman(
                    "build",
                    "--quiet",
                    "--format=docker",  # keeps HEALTHCHECK (the OCI format has none)
                    "--network=host",
                    "--pull=never",
                    f"--build-arg=BASE={image.base.ref}",
                    f"--build-arg=REVISION={_revision()}",
                    f"--label={HASH_LABEL}={wanted}",
                    f"--tag={image.ref}",
                    "--file",
                    str(context / "Containerfile"),
                    str(context),
                    timeout=1800,
                )
            how = "built"
            info = ri._image_info(image.ref)
            if info is None:
                raise RuntimeError(f"podman build did not produce {image.ref}")
    return BuiltImage(image.ref, str(info["Id"]), int(info.get("Size", 0)), how, time.monotonic() - t0)


def ensure_infra_images(names: tuple[str, ...] = tuple(IMAGES), *, rebuild: bool = False) -> list[BuiltImage]:
    return [ensure_image(IMAGES[n], rebuild=rebuild) for n in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpuaas.devstack.infra_images", description=(__doc__ or "").split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build (or reuse) the images; print each one's size")
    build.add_argument("--rebuild", action="store_true", help="ignore the caches: mmdebstrap and podman build again")
    build.add_argument("names", nargs="*", help=f"some of {', '.join(IMAGES)} (default: all)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in IMAGES]
    if unknown:
        parser.error(f"unknown images {unknown}: {', '.join(IMAGES)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s %(message)s", datefmt="%H:%M:%S")
    try:
        images = ensure_infra_images(tuple(args.names) or tuple(IMAGES), rebuild=args.rebuild)
    except ri.ImageToolsMissing as exc:
        print(exc, file=sys.stderr)
        return 1
    for im in images:
        print(f"{im.ref:<36} {im.built:<7} {im.seconds:6.1f}s  {im.size_bytes / 1e6:6.1f} MB  {im.image_id[:12]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
