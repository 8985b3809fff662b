"""The fast lane (`make test-unit`, the root conftest.py): a test's lane follows from the fixtures it uses, and in
the lane (GPUAAS_TEST_LANE=unit) the session's Postgres and broker, and server programs, refuse to start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
UNIT = ("-m", "not integration and not e2e")
# Light modules (each child pytest imports what it collects), one per kind of fixture: the session's Postgres +
# broker, a whole stack, and the gateway's upstreams served in the test process (a fixture named `stack` too).
DB = "tests/ops/test_chart_migrate.py"
STACK = "tests/e2e/test_golden_path.py"
IN_PROCESS = "services/gateway/tests/test_console.py"


def pytest_in_lane(*args: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"GPUAAS_TEST_LANE": "unit"}
    quick = ("-p", "no:cacheprovider", "-p", "no:schemathesis", "-p", "no:hypothesispytest")  # unused here: seconds
    command = [sys.executable, "-m", "pytest", "-q", *quick, *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_tests_whose_fixtures_start_servers_are_not_in_the_lane() -> None:
    done = pytest_in_lane("--collect-only", *UNIT, DB, STACK, IN_PROCESS)
    assert done.returncode == 0, done.stdout + done.stderr
    selected = {line.split("::")[0] for line in done.stdout.splitlines() if "::" in line}
    assert selected == {IN_PROCESS}
    assert " deselected" in done.stdout


def test_in_the_lane_the_session_servers_and_server_programs_refuse_to_start(request: pytest.FixtureRequest) -> None:
    if os.environ.get("GPUAAS_TEST_LANE") != "unit":
        pytest.skip("checks the unit lane itself (make test-unit)")  # elsewhere `infra` would start Postgres
    with pytest.raises(RuntimeError, match="must not start Postgres or the broker"):
        request.getfixturevalue("infra")  # what a unit test whose fixtures were missed would reach
    with pytest.raises(RuntimeError, match="does not start podman: mark the test integration"):
        subprocess.run(["podman", "ps"], capture_output=True, check=False)
    with pytest.raises(RuntimeError, match="does not start postgres"):
        subprocess.Popen("/usr/lib/postgresql/15/bin/postgres -D /nonexistent", shell=True)
    assert subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True, text=True).stdout == "1\n"
