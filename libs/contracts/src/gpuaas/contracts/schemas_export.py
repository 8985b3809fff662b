"""Write (or check) the committed event schemas and the AsyncAPI document.

    uv run python -m gpuaas.contracts.schemas_export            # regenerate libs/contracts/schemas
    uv run python -m gpuaas.contracts.schemas_export --check    # CI: fail if stale or breaking

Before writing, the new schemas are compared with the ones on disk; a backward-incompatible
change is refused (exit 2) unless `--allow-breaking` is given, which is only right when the
change goes into a new topic version. Files that are no longer generated are removed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from gpuaas.contracts.compat import breaking, compare_files, format_changes
from gpuaas.contracts.schemas import default_schema_dir, dumps, generate, load_dir


def stale_files(directory: Path, rendered: dict[str, str]) -> list[str]:
    """Paths whose committed text differs from the generated text (missing, changed or extra)."""
    on_disk = {p.relative_to(directory).as_posix() for p in directory.rglob("*.json")} if directory.is_dir() else set()
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuaas.contracts.schemas_export", description=__doc__)
    parser.add_argument("--out", type=Path, default=default_schema_dir(), help="schema directory")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale or breaking")
    parser.add_argument("--allow-breaking", action="store_true", help="write even a breaking change")
    args = parser.parse_args(argv)
    if args.out is None:
        parser.error("--out is required outside a source checkout")
    directory: Path = args.out

    documents = generate()
    rendered = {path: dumps(doc) for path, doc in documents.items()}
    changes = compare_files(load_dir(directory), documents)
    broken = breaking(changes)
    if changes:
        print(format_changes(changes), file=sys.stderr)

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
