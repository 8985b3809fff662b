"""Build the standalone gpuaas-contracts wheel and prove it installs and works without the platform.

    uv run python scripts/contracts_wheel.py [--out dist/contracts] [--no-check]

1. `uv build --package gpuaas-contracts --wheel` (uv_build: the `gpuaas.contracts` package only);
2. adds the committed JSON Schemas and AsyncAPI document (`libs/contracts/schemas/`, checked up to date
   first) as package data under `gpuaas/contracts/jsonschemas/`, and rewrites the wheel's RECORD (uv_build
   packs only what is under the module directory, and the schema directory stays where the compatibility
   tooling and its git history expect it);
3. the check: a fresh virtualenv (no workspace, no platform), `pip install` of the wheel alone, then in an
   isolated interpreter (`-I`, run from the virtualenv's directory): the installed distributions are the
   wheel and pydantic's own, no other `gpuaas.*` package is importable, an event JSON validates into its
   typed class, and the packaged schemas equal what the installed code generates; then a second fresh
   virtualenv with `gpuaas-contracts[faststream]` imports the FastStream integration.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = ROOT / "libs" / "contracts" / "schemas"
PACKAGE_DATA = "gpuaas/contracts/jsonschemas"

CHECK = r"""
import importlib.metadata as md, importlib.util, json, sys
from decimal import Decimal

dists = sorted(d.metadata["Name"].lower().replace("_", "-") for d in md.distributions())
allowed = {"gpuaas-contracts", "pydantic", "pydantic-core", "annotated-types", "typing-extensions",
           "typing-inspection", "pip", "setuptools", "wheel"}
assert set(dists) <= allowed, f"unexpected distributions: {sorted(set(dists) - allowed)}"
for mod in ("gpuaas.kit", "gpuaas.sdk", "gpuaas.billing", "faststream", "sqlalchemy", "fastapi"):
    assert importlib.util.find_spec(mod.split(".")[0]) is None or importlib.util.find_spec(mod) is None, mod

import gpuaas.contracts as c
from gpuaas.contracts.events.billing import ChargePosted
from gpuaas.contracts.packaged import PACKAGED, asyncapi_document, schema_dir
from gpuaas.contracts.schema_files import dumps, generate
from gpuaas.contracts.testing import sample_event

assert "site-packages" in c.__file__, c.__file__
wire = sample_event(ChargePosted).model_dump_json()
event = c.parse_event("gpuaas.billing.v1", wire)
assert type(event) is ChargePosted and isinstance(event.data.amount, Decimal), event
try:
    c.parse_event("gpuaas.billing.v1", json.loads(wire) | {"data": {"amount": "x"}})
except Exception as exc:
    assert type(exc).__name__ == "ValidationError", exc
else:
    raise AssertionError("an invalid charge validated")
assert schema_dir() == PACKAGED, schema_dir()
generated = generate()
shipped = {p.relative_to(PACKAGED).as_posix(): p.read_text() for p in PACKAGED.rglob("*.json")}
assert set(shipped) == set(generated), sorted(set(shipped) ^ set(generated))
stale = [p for p, doc in generated.items() if dumps(doc) != shipped[p]]
assert not stale, f"packaged schemas differ from the code: {stale}"
assert asyncapi_document()["info"]["version"] == md.version("gpuaas-contracts")
print(f"ok: gpuaas-contracts {md.version('gpuaas-contracts')} alone ({', '.join(dists)}); "
      f"{len(shipped)} schema files; {type(event).__name__} validated")
"""


def uv() -> str:
    found = shutil.which("uv") or str(Path.home() / ".local" / "bin" / "uv")
    if not Path(found).exists():
        sys.exit("uv not found")
    return found


def run(*cmd: str, **kw: object) -> None:
    print("+", " ".join(c if len(c) < 200 else "<check script>" for c in cmd), flush=True)
    if subprocess.run(cmd, check=False, **kw).returncode != 0:  # type: ignore[call-overload]
        sys.exit(f"failed: {cmd[0]} {cmd[1] if len(cmd) > 1 else ''}")


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def add_schemas(wheel: Path) -> int:
    """Rewrite `wheel` with the schema files as package data; returns how many were added."""
    files = sorted(p for p in SCHEMAS.rglob("*.json"))
    if not files:
        sys.exit(f"no schema files under {SCHEMAS}")
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        record = [line for line in src.read(record_name).decode().splitlines() if line and line != f"{record_name},,"]
        for info in src.infolist():
            if info.filename != record_name:
                dst.writestr(info, src.read(info.filename))
        for path in files:
            name = f"{PACKAGE_DATA}/{path.relative_to(SCHEMAS).as_posix()}"
            data = path.read_bytes()
            dst.writestr(name, data)
            record.append(record_line(name, data))
        dst.writestr(record_name, "\n".join([*record, f"{record_name},,"]) + "\n")
    tmp.replace(wheel)
    return len(files)


CHECK_EXTRA = r"""
import gpuaas.contracts.faststream as fs
from faststream.kafka import KafkaBroker
broker = KafkaBroker("localhost:9092")
doc = fs.asyncapi(broker, title="probe")
assert doc["asyncapi"] == "3.0.0" and fs.event_union("gpuaas.billing.v1") is not None
print("ok: gpuaas-contracts[faststream] imports its FastStream integration")
"""


def check(wheel: Path, *, extra: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="contracts-wheel-") as tmp:
        for name, requirement, script in [
            ("base", str(wheel), CHECK),
            *([("extra", f"{wheel}[faststream]", CHECK_EXTRA)] if extra else []),
        ]:
            venv = Path(tmp) / name
            run(uv(), "venv", "--quiet", "--python", "3.11", "--no-project", str(venv), cwd=tmp)
            python = venv / "bin" / "python"
            run(uv(), "pip", "install", "--quiet", "--no-config", "--python", str(python), requirement, cwd=tmp)
            run(str(python), "-I", "-c", script, cwd=tmp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "dist" / "contracts")
    parser.add_argument("--no-check", action="store_true", help="build only")
    parser.add_argument("--no-extra", action="store_true", help="skip the check of the [faststream] extra")
    args = parser.parse_args()
    run(sys.executable, "-m", "gpuaas.contracts.schemas_export", "--check", cwd=ROOT)
    shutil.rmtree(args.out, ignore_errors=True)
    run(uv(), "build", "--quiet", "--package", "gpuaas-contracts", "--wheel", "--out-dir", str(args.out), cwd=ROOT)
    [wheel] = sorted(args.out.glob("gpuaas_contracts-*.whl"))
    print(f"{wheel.name}: added {add_schemas(wheel)} schema files under {PACKAGE_DATA}/")
    if not args.no_check:
        check(wheel, extra=not args.no_extra)
    print(wheel)


if __name__ == "__main__":
    main()
