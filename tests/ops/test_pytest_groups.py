"""`make test`'s group runner (scripts/pytest_groups.py): groups cover the testpaths, a group whose interpreter dies
of a signal runs once more (and a second death fails), a failing group is never rerun, and a path argument runs
one plain pytest."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pytest_groups", ROOT / "scripts" / "pytest_groups.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _scripted(monkeypatch: pytest.MonkeyPatch, module: ModuleType, exits: dict[str, list[int]]) -> list[str]:
    calls: list[str] = []

    def run(group: tuple[str, ...], args: list[str]) -> int:
        name = " ".join(group)
        calls.append(name)
        return exits.get(name, [0]).pop(0) if exits.get(name) else 0

    monkeypatch.setattr(module, "_run", run)
    return calls


def test_groups_are_the_testpaths_in_order() -> None:
    testpaths = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["testpaths"]
    assert [folder for group in _runner().GROUPS for folder in group] == testpaths


def test_a_group_killed_by_a_signal_runs_once_more(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _runner()
    calls = _scripted(monkeypatch, module, {"services": [-11, 0]})
    assert module.main(["--ignore=tests/e2e"]) == 0
    assert calls.count("services") == 2 and calls.count("libs") == 1


def test_a_second_death_or_a_failure_fails_and_a_failure_is_not_rerun(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _runner()
    calls = _scripted(monkeypatch, module, {"services": [-11, -11], "tests": [1]})
    assert module.main([]) == 1
    assert calls.count("services") == 2 and calls.count("tests") == 1


def test_nothing_collected_anywhere_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _runner()
    _scripted(monkeypatch, module, {" ".join(g): [5] for g in module.GROUPS})
    assert module.main(["-k", "no_such_test"]) == 1


def test_a_path_argument_runs_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _runner()
    calls = _scripted(monkeypatch, module, {})
    assert module.main(["--ignore", "tests/e2e", "services/identity"]) == 0
    assert calls == [""]
    calls.clear()
    assert module.main(["--ignore", "tests/e2e"]) == 0
    assert len(calls) == len(module.GROUPS)


def test_explicit_groups_replace_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _runner()
    calls = _scripted(monkeypatch, module, {"services agents": [-6, 0]})
    assert module.main(["--group=libs", "--group=services agents", "--ignore", "x"]) == 0
    assert calls == ["libs", "services agents", "services agents"]  # the aborted group ran once more
