"""`make test`: the suite in a few pytest processes, one per group of folders, so one process's fate is not all's.

    uv run python scripts/pytest_groups.py [pytest arguments...]

Why groups: one pytest process for ~1700 tests lives ~45 minutes, runs hundreds of event loops in TestClient
threads and SQLAlchemy's greenlets, and once (CI, 2026-11) died of a segmentation fault inside CPython 3.11's
frame handling (faulthandler showed a lifespan frame chained to SQLAlchemy compiler frames of another greenlet:
corrupted interpreter state, not a test's assertion). A process per group keeps such a death local.

A group whose interpreter is killed by a signal (segfault, abort) is run once more, and the log says so and
keeps the first run's faulthandler dump: a test that *fails* is never rerun, and a second death fails the run.
Arguments are passed to every group's pytest; a path argument (TEST_ARGS=services/identity) runs just that,
in one process. `--group=PATHS` (repeatable; paths separated by spaces) replaces the default groups.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The testpaths of pyproject.toml, in its order, cut where the fixtures they share end (each group starts its
# own embedded Postgres and broker once: ~10 s).
GROUPS: tuple[tuple[str, ...], ...] = (
    ("libs",),
    ("services",),
    ("agents", "controllers", "deploy", "cli", "examples"),
    ("tests",),
)
NO_TESTS_COLLECTED = 5


# Options whose value is a separate argument that may itself be a path (`--ignore tests/e2e`).
VALUE_OPTIONS = frozenset({"--ignore", "--ignore-glob", "--deselect", "-k", "-m", "-p", "--rootdir", "-c"})


def _names_a_path(args: list[str]) -> bool:
    return any(
        not arg.startswith("-") and prev not in VALUE_OPTIONS and (ROOT / arg.split("::")[0]).exists()
        for prev, arg in zip(["", *args], args, strict=False)
    )


# Every run names its slowest tests, so a CI log says where its minutes went (the 90-minute budget is real).
DURATIONS = ("--durations=15", "--durations-min=15")


def _run(group: tuple[str, ...], args: list[str]) -> int:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *DURATIONS, *args, *group]
    started = time.monotonic()
    print(f"== pytest {' '.join(group)}", flush=True)
    rc = subprocess.call(command, cwd=ROOT)
    print(f"== {' '.join(group)}: exit {rc} after {time.monotonic() - started:.0f} s", flush=True)
    return rc


def main(args: list[str]) -> int:
    chosen = tuple(tuple(a.removeprefix("--group=").split()) for a in args if a.startswith("--group="))
    args = [a for a in args if not a.startswith("--group=")]
    groups = chosen or GROUPS
    if _names_a_path(args):  # the caller chose what to run: one process, as plain pytest
        return _run((), args)
    failed: list[str] = []
    collected_nothing = 0
    for group in groups:
        rc = _run(group, args)
        if rc < 0:  # killed by a signal: the interpreter died, no test's verdict was reached
            name = signal.Signals(-rc).name
            print(f"== {' '.join(group)}: the interpreter died of {name}; running the group once more", flush=True)
            rc = _run(group, args)
        if rc == NO_TESTS_COLLECTED:
            collected_nothing += 1
        elif rc != 0:
            failed.append(f"{' '.join(group)} (exit {rc})")
    if collected_nothing == len(groups):
        failed.append("every group: no tests collected")
    if failed:
        print(f"== failed: {', '.join(failed)}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
