"""The executable steps of docs/app-controllers.md: each fenced block after a `<!-- guide-step: NAME -->` line.

Python steps run in order in one namespace, as a reader runs them in `python -m asyncio` (top-level `await`),
so a later step uses the names an earlier one defined (`op`, `user`, `lead`, `PROJECT_ID`, `A0`, `inst`, ...).
The test reads those names back from `Guide.ns` to check the outcome; it substitutes none of them: the guide's
first step reads the stack from `.local/stack.json` in the working directory, as on a `make run` stack.
"""

from __future__ import annotations

import ast
import asyncio
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "app-controllers.md"
# The app team's path through the guide, in the order a reader meets it (issue 33: none may go missing).
STEPS = (
    "stack",
    "team",
    "allocations",
    "publish",
    "project",
    "run",
    "deploy",
    "scale-up",
    "scale-down",
    "decommission",
)
_STEP = re.compile(r"^<!-- guide-step: ([a-z0-9-]+) -->\n```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Step:
    name: str
    lang: str  # "python" or "sh"
    source: str
    line: int  # of the fence, for error messages

    def compile(self) -> Any:
        """The step as code that may `await` at top level (what `python -m asyncio` accepts)."""
        return compile(self.source, f"{GUIDE.name}:{self.name}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


def steps(text: str | None = None) -> list[Step]:
    text = GUIDE.read_text() if text is None else text
    return [Step(m[1], m[2], m[3], text.count("\n", 0, m.start()) + 2) for m in _STEP.finditer(text)]


@dataclass
class Guide:
    """Runs the guide's Python steps one by one, in the guide's order (a step cannot be skipped or reordered)."""

    ns: dict[str, Any] = field(default_factory=lambda: {"__name__": "__guide__"})
    _todo: list[Step] = field(default_factory=steps)

    def step(self, name: str) -> Step:
        assert self._todo, f"the guide has no step left, {name!r} asked"
        nxt = self._todo.pop(0)
        assert nxt.name == name, f"the guide's next step is {nxt.name!r}, not {name!r}"
        return nxt

    def remaining(self) -> list[str]:
        return [s.name for s in self._todo]

    async def run(self, name: str, *, timeout_s: float = 240) -> None:
        step = self.step(name)
        assert step.lang == "python", step
        result = eval(step.compile(), self.ns)  # a coroutine when the step awaits, else None
        if asyncio.iscoroutine(result):
            await asyncio.wait_for(result, timeout_s)
