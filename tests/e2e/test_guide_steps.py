"""The unit-lane half of the guide's test (no stack): docs/app-controllers.md has every step of the app team's path,
in order, and each Python step compiles. test_echo_controller.py runs the same steps on the e2e stack."""

from __future__ import annotations

import shlex

from tests.e2e.guide import STEPS, steps


def test_the_guide_has_every_step_in_order() -> None:
    assert tuple(s.name for s in steps()) == STEPS


def test_every_python_step_compiles() -> None:
    for step in steps():
        if step.lang == "python":
            step.compile()  # a SyntaxError names the step and its line
        else:
            assert step.lang == "sh", step
            shlex.split(step.source.replace("\\\n", " "))


def test_the_run_step_runs_the_example_with_the_service_account_of_the_project_step() -> None:
    run = next(s for s in steps() if s.name == "run").source
    assert "gpuaas-controller run echo_controller:EchoController --app-slug echo" in run
    for name in ("$GATEWAY", "$CLIENT_ID", "$CLIENT_SECRET"):  # names the Python steps define
        assert name in run
    project = next(s for s in steps() if s.name == "project").source
    assert "CLIENT_ID, CLIENT_SECRET =" in project
