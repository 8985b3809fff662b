"""docs/app-controllers.md's role → permission table says what `gpuaas.kit.iam` enforces: every row, every
role column and the `app-controller` scope column (the guide is the app team's only reference)."""

from __future__ import annotations

from pathlib import Path

from gpuaas.kit.iam import PERMISSIONS, SCOPE_ACTIONS

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "app-controllers.md"


def test_the_guide_table_matches_the_role_definitions() -> None:
    lines = GUIDE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| action | platform_admin"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    roles, rows = header[1:-1], []
    for line in lines[start + 2 :]:
        if not line.startswith("| `"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    assert len(rows) >= 20
    for cells in rows:
        action = cells[0].strip("`")
        allowed = {r.value for r in PERMISSIONS[action]}
        documented = {role for role, mark in zip(roles, cells[1:-1], strict=True) if mark == "✓"}
        assert documented == allowed, action
        assert (cells[-1] == "✓") == (action in SCOPE_ACTIONS["app-controller"]), action
