"""`make images`: the platform image (and the bases it needs here) built with podman, each image's size printed.

    python deploy/images/services/build.py [--base-image REF] [--skip-console]

1. The bases, unless `--base-image` names one (outside: docker.io/library/python:3.11-slim-bookworm): Debian 12
   root filesystems made by mmdebstrap from the recipes next to this file (gpuaas-python.toml: Python 3.11;
   gpuaas-nginx.toml: the load balancer of the compose deployment), through the same code that builds the
   runtime images (gpuaas.devstack.runtime_images: cached by recipe hash under ~/.cache/gpuaas/runtime-images,
   so a second run only checks that the podman image carries the recipe's hash).
2. The web console (`make console` builds web/console/dist before this runs; the Containerfile copies it).
3. `podman build --network=host` of deploy/images/services/Containerfile with BASE_IMAGE, VERSION and
   REVISION (git): one image, localhost/gpuaas-platform:<version>, whose command picks the component.
   podman's layer cache makes a second build with unchanged sources take seconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from gpuaas.devstack import runtime_images as ri

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
PLATFORM_IMAGE = "localhost/gpuaas-platform"
BASES = {"gpuaas-python": "localhost/gpuaas-python", "gpuaas-nginx": "localhost/gpuaas-nginx"}
SIZE_GOAL_MB = 250
# The build host's CA bundle, a build secret of the RUN steps that reach PyPI (a TLS-inspecting proxy's CA is
# often only there); never stored in a layer.
BUILD_CA = os.environ.get("GPUAAS_BUILD_CA", "/etc/ssl/certs/ca-certificates.crt")

log = logging.getLogger("gpuaas.images")


def _podman(*args: str, capture: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["podman", *args], env=ri.podman_env(), capture_output=capture, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"podman {args[0]} failed ({r.returncode}): {(r.stderr or '')[-2000:]}")
    return r


def image_size_mb(ref: str) -> float:
    info = json.loads(_podman("image", "inspect", ref).stdout)[0]
    return int(info.get("Size", 0)) / 1e6


def _purge_hooks(slug: str) -> list[str]:
    """Packages the recipe's `purge` list removes after the install: mmdebstrap's usrmerge step pulls in the
    full Perl (~50 MB) that nothing in the image runs (perl-base, which dpkg needs, stays)."""
    purge = tomllib.loads((HERE / f"{slug}.toml").read_text()).get("purge", [])
    if not purge:
        return []
    names = " ".join(purge)
    # dpkg, not apt, in the hook (apt-get there left /sys busy for mmdebstrap's unmount). init-system-helpers
    # depends on usrmerge | usr-is-merged: whoever installs with apt on top installs usr-is-merged first (the
    # platform image's build stage does).
    return [f'--customize-hook=chroot "$1" dpkg --purge --force-depends {names}']


def ensure_base(slug: str) -> str:
    """The base image `slug` in podman's storage (built by mmdebstrap only when its recipe changed)."""
    recipe = ri.load_recipe(slug, HERE)
    ref = f"{BASES[slug]}:{recipe.version}"
    with ri._locked(slug):
        info = ri._image_info(ref)
        labels = (info or {}).get("Labels") or {}
        if info is not None and labels.get(ri.HASH_LABEL) == recipe.recipe_hash:
            return ref
        if not recipe.tar_path.exists():
            ri.require_tools("mmdebstrap")
            log.info("building %s with mmdebstrap (a minute or two)", ref)
            with tempfile.TemporaryDirectory(dir=ri.CACHE_DIR) as tmp:
                out = Path(tmp) / "rootfs.tar"
                ri.debian_rootfs(out, recipe.packages, exclude=recipe.exclude, hooks=_purge_hooks(slug), what=slug)
                out.replace(recipe.tar_path)
            for stale in ri.CACHE_DIR.glob(f"{slug}-*.tar"):
                if stale != recipe.tar_path:
                    stale.unlink(missing_ok=True)
        changes = [
            "ENV LANG=C.UTF-8",
            "WORKDIR /",
            'CMD ["/bin/bash"]',
            f"LABEL {ri.HASH_LABEL}={json.dumps(recipe.recipe_hash)}",
            f"LABEL org.opencontainers.image.title={json.dumps(slug)}",
            f"LABEL org.opencontainers.image.version={json.dumps(recipe.version)}",
        ]
        args = [a for c in changes for a in ("--change", c)]
        _podman("import", *args, "--message", f"{slug} {recipe.version}", str(recipe.tar_path), ref)
    return ref


def workspace_version() -> str:
    return str(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"])


def git_revision() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    rev = git("rev-parse", "HEAD") or "unknown"
    return rev + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def build_platform(base: str, version: str) -> str:
    ref = f"{PLATFORM_IMAGE}:{version}"
    if not (REPO / "web" / "console" / "dist" / "index.html").exists():
        raise SystemExit("web/console/dist is missing: run `make console` first (make images does)")
    cmd = [
        "build",
        "--network=host",
        "--layers",
        "--format",
        "docker",
        "--ignorefile",
        str(HERE / "containerignore"),
        "-f",
        str(HERE / "Containerfile"),
        "--secret",
        f"id=build-ca,src={BUILD_CA}",
        "--build-arg",
        f"BASE_IMAGE={base}",
        "--build-arg",
        f"VERSION={version}",
        "--build-arg",
        f"REVISION={git_revision()}",
        "-t",
        ref,
        "-t",
        f"{PLATFORM_IMAGE}:latest",
        str(REPO),
    ]
    subprocess.run(["podman", *cmd], env=ri.podman_env(), check=True)
    return ref


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--base-image", help="FROM image of the platform image (default: built here)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s %(message)s", datefmt="%H:%M:%S")
    ri.require_tools("podman")
    t0 = time.monotonic()
    built = [ensure_base("gpuaas-nginx")]
    base = args.base_image or ensure_base("gpuaas-python")
    if not args.base_image:
        built.insert(0, base)
    built.append(build_platform(base, workspace_version()))
    print(f"\nimages ({time.monotonic() - t0:.0f} s):")
    for ref in built:
        size = image_size_mb(ref)
        flag = f"  (over the {SIZE_GOAL_MB} MB goal)" if ref.startswith(PLATFORM_IMAGE) and size > SIZE_GOAL_MB else ""
        print(f"  {ref:<44} {size:7.1f} MB{flag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
