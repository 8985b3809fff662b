"""Write (or check) the committed event schemas and the AsyncAPI document; cut the release baseline.

    uv run python -m gpuaas.contracts.schemas_export                 # regenerate libs/contracts/schemas
    uv run python -m gpuaas.contracts.schemas_export --check         # CI: fail if stale or breaking
    uv run python -m gpuaas.contracts.schemas_export --cut-baseline  # at a release: libs/contracts/baseline

Before writing, the new schemas are compared with the ones on disk and with the release baseline
(gpuaas.contracts.schema_files); a backward-incompatible change is refused (exit 2) unless
`--allow-breaking` is given, which is only right when the change goes into a new topic version.
Files that are no longer generated are removed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuaas.contracts.compat import Change, breaking, compare_files, format_changes
from gpuaas.contracts.schema_files import (
    default_baseline_dir,
    default_schema_dir,
    dumps,
    generate,
    load_baseline,
    load_dir,
    write_baseline,
)


def stale_files(directory: Path, rendered: dict[str, str]) -> list[str]:
    """Paths whose committed text differs from the generated text (missing, changed or extra)."""
    on_disk = (
        {p.relative_to(directory).as_posix() for p in directory.rglob("*.json")} if directory.is_dir() else set[str]()
    )
    stale = [path for path, text in rendered.items() if not _same(directory / path, text)]
    return sorted(stale + [path for path in on_disk if path not in rendered])


def _same(path: Path, text: str) -> bool:
    return path.is_file() and path.read_text(encoding="utf-8") == text


def write(directory: Path, rendered: dict[str, str]) -> list[str]:
    """Write changed files and delete files no longer generated; returns the touched paths."""
    touched = stale_files(directory, rendered)
    for path in touched:
        target = directory / path
        if path in rendered:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(rendered[path], encoding="utf-8")
        else:
            target.unlink()
    for folder in sorted((p for p in directory.rglob("*") if p.is_dir()), reverse=True):
        if not any(folder.iterdir()):
            folder.rmdir()
    return touched


def head_commit(directory: Path) -> str:
    """The commit checked out where `directory` lives ("unknown" outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=directory, capture_output=True, text=True, check=False)
    except OSError:
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def broken_since_baseline(directory: Path | None, documents: dict[str, dict[str, Any]]) -> list[Change]:
    """The breaking changes between the release baseline under `directory` and `documents`."""
    baseline = load_baseline(directory) if directory else None
    if baseline is None:
        return []
    broken = breaking(compare_files(baseline.files, documents))
    if broken:
        print(
            f"backward-incompatible since release {baseline.version} (commit {baseline.commit}):\n"
            + format_changes(broken),
            file=sys.stderr,
        )
    return broken


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuaas.contracts.schemas_export", description=__doc__)
    parser.add_argument("--out", type=Path, default=default_schema_dir(), help="schema directory")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale or breaking")
    parser.add_argument("--allow-breaking", action="store_true", help="write even a breaking change")
    parser.add_argument("--baseline", type=Path, default=default_baseline_dir(), help="release baseline directory")
    parser.add_argument(
        "--cut-baseline", action="store_true", help="at a release: make the current schemas the baseline"
    )
    args = parser.parse_args(argv)
    if args.out is None:
        parser.error("--out is required outside a source checkout")
    directory: Path = args.out

    documents = generate()
    if args.cut_baseline:
        if args.baseline is None:
            parser.error("--baseline is required outside a source checkout")
        cut = write_baseline(args.baseline, documents, head_commit(args.baseline.parent))
        print(f"baseline of release {cut.version} (commit {cut.commit}): {len(cut.files)} file(s) in {args.baseline}")
        return 0
    rendered = {path: dumps(doc) for path, doc in documents.items()}
    changes = compare_files(load_dir(directory), documents)
    if changes:
        print(format_changes(changes), file=sys.stderr)
    broken = breaking(changes) + broken_since_baseline(args.baseline, documents)

    if args.check:
        stale = stale_files(directory, rendered)
        for path in stale:
            print(f"stale: {path}", file=sys.stderr)
        if stale:
            print("run: uv run python -m gpuaas.contracts.schemas_export", file=sys.stderr)
        return 1 if stale or broken else 0

    if broken and not args.allow_breaking:
        print(
            f"refusing to write {len(broken)} backward-incompatible change(s); add fields as optional, "
            "or publish a new topic version (then --allow-breaking)",
            file=sys.stderr,
        )
        return 2
    touched = write(directory, rendered)
    print(f"{len(touched)} file(s) updated in {directory} ({len(rendered)} generated)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
