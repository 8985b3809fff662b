"""The docs stay in step with the tree (issue 26): the layout map of docs/development.md names every folder and every
workspace member, and every path it names exists; every `make <target>` a doc names is a Makefile target; the Debian
packages the docs list are the Makefile's; and every doc a reader needs is inside the repository (relative links
resolve to files here, anchors to headings there, and no doc points at an absolute or outside path)."""

from __future__ import annotations

import re
import subprocess
import tomllib
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEVELOPMENT = ROOT / "docs" / "development.md"
# Folders each of whose sub-folders is a part of its own (a member, a suite, a deployment) and has a line in the map.
GROUPS = ("agents", "controllers", "deploy", "examples", "libs", "services", "tests", "web")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
TARGET = re.compile(r"[a-z][a-z0-9-]*")


@cache
def tree() -> tuple[str, ...]:
    """The files of the working tree that git would commit: tracked, plus new files not ignored."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    return tuple(f for f in listed if (ROOT / f).exists())


def folders(depth: int) -> set[str]:
    return {"/".join(parts[:depth]) for f in tree() if len(parts := f.split("/")) > depth}


def docs() -> list[Path]:
    return sorted(ROOT / f for f in tree() if f.endswith(".md"))


def layout_entries() -> list[str]:
    """The first column of the layout map: the code block under `## Layout` in docs/development.md."""
    text = DEVELOPMENT.read_text()
    section = text.split("\n## Layout\n", 1)[1]
    block = FENCE.search(section)
    assert block, "docs/development.md: no code block under ## Layout"
    return [line.split()[0].rstrip("/") for line in block.group(1).splitlines() if line and not line[0].isspace()]


def as_pattern(entry: str) -> re.Pattern[str]:
    """`services/<name>` stands for any one folder there."""
    return re.compile("/".join("[^/]+" if re.fullmatch(r"<[^>]+>", p) else re.escape(p) for p in entry.split("/")))


def named_by_map(folder: str, entries: list[str]) -> bool:
    return any(as_pattern(e).fullmatch(folder) for e in entries)


def workspace_members() -> set[str]:
    workspace = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["uv"]["workspace"]
    found = {
        str(p.parent.relative_to(ROOT))
        for pattern in workspace["members"] + workspace.get("exclude", [])
        for p in ROOT.glob(f"{pattern}/pyproject.toml")
    }
    assert found, "no workspace member found"
    return found


def test_the_layout_map_names_every_folder_and_every_workspace_member() -> None:
    entries = layout_entries()
    top = folders(1)
    missing_top = sorted(f for f in top if not any(e == f or e.startswith(f"{f}/") for e in entries))
    assert not missing_top, f"top-level folders missing from docs/development.md's layout map: {missing_top}"
    parts = {f for f in folders(2) if f.split("/")[0] in GROUPS}
    missing = sorted(f for f in parts | workspace_members() if not named_by_map(f, entries))
    assert not missing, f"folders missing from docs/development.md's layout map: {missing}"


def test_every_path_the_layout_map_names_exists() -> None:
    block = FENCE.search(DEVELOPMENT.read_text().split("\n## Layout\n", 1)[1])
    assert block
    top = folders(1)
    path = re.compile(r"(?<![\w./-])(?:" + "|".join(map(re.escape, sorted(top))) + r")(?:/[\w.<>*-]+)*/?")
    named = {m.group(0).rstrip("/.") for m in path.finditer(block.group(1))}
    assert {"services/<name>", "deploy/helm", "controllers/slurm-reference"} <= named, sorted(named)
    dirs = folders(2) | folders(3) | folders(4) | top
    gone = sorted(n for n in named if not (ROOT / n).exists() and not any(as_pattern(n).fullmatch(d) for d in dirs))
    assert not gone, f"the layout map names paths that do not exist: {gone}"


@cache
def makefile_targets() -> set[str]:
    targets: set[str] = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        if m := re.match(r"([A-Za-z0-9][\w.-]*(?: +[\w.-]+)*) *:(?!=)", line):
            targets.update(m.group(1).split())
    return targets


def make_commands(text: str) -> list[str]:
    """`make a b` in code spans and fenced blocks (a `VAR=value` argument ends the list of targets)."""
    commands = CODE_SPAN.findall(text)
    commands += [line.strip() for block in FENCE.findall(text) for line in block.splitlines()]
    named: list[str] = []
    for command in commands:
        words = command.split()
        if len(words) < 2 or words[0] != "make":
            continue
        for word in words[1:]:
            if not TARGET.fullmatch(word):
                break
            named.append(word)
    return named


def test_every_make_target_the_docs_name_exists() -> None:
    targets = makefile_targets()
    assert {"run", "test", "install", "lint"} <= targets, sorted(targets)
    readme = make_commands((ROOT / "README.md").read_text())
    assert {"run", "test"} <= set(readme), readme
    unknown = sorted(
        {
            f"{doc.relative_to(ROOT)}: make {name}"
            for doc in docs()
            for name in make_commands(doc.read_text())
            if name not in targets
        }
    )
    assert not unknown, f"docs name make targets the Makefile does not have: {unknown}"


def test_the_debian_packages_the_docs_list_are_the_makefiles() -> None:
    makefile = (ROOT / "Makefile").read_text()
    m = re.search(r"^APT_PACKAGES :=((?:.*\\\n)*.*)$", makefile, re.M)
    assert m, "APT_PACKAGES not found in the Makefile"
    wanted = set(m.group(1).replace("\\\n", " ").split())
    listed = next(
        (set(b.split()) for b in FENCE.findall(DEVELOPMENT.read_text()) if {"podman", "skopeo"} <= set(b.split())),
        set(),
    )
    assert listed == wanted, f"docs/development.md lists {sorted(listed ^ wanted)} differently from the Makefile"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(doc: Path) -> set[str]:
    text = FENCE.sub("", doc.read_text())
    return {slug(h) for h in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M)}


def test_links_stay_inside_the_repository_and_resolve() -> None:
    broken: list[str] = []
    for doc in docs():
        for target in LINK.findall(FENCE.sub("", doc.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: outside by nature, not a file
                continue
            path_part, _, anchor = target.partition("#")
            where = f"{doc.relative_to(ROOT)}: {target}"
            if path_part.startswith("/"):
                broken.append(f"{where} (an absolute path)")
                continue
            resolved = (doc.parent / path_part).resolve() if path_part else doc
            if not resolved.is_relative_to(ROOT):
                broken.append(f"{where} (outside the repository)")
            elif not resolved.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{where} (no such heading)")
    assert not broken, "\n".join(broken)


def test_no_doc_points_outside_the_repository() -> None:
    outside = re.compile(r"(?<![\w.])/work/|\.\./shared/|(?<![\w/])~/work\b")
    found = [
        f"{doc.relative_to(ROOT)}:{n}: {line.strip()}"
        for doc in docs()
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        if outside.search(line)
    ]
    assert not found, "\n".join(found)
