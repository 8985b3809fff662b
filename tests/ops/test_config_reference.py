"""The configuration reference in docs/operations.md is generated from the settings classes and must be current;
the Helm chart sets only variables some component reads (the rendered check is `make chart-check`)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "deploy" / "helm" / "gpuaas" / "templates"


def load(name: str) -> ModuleType:
    """A script of scripts/ as a module (they import each other by name, as when run from there)."""
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def test_the_committed_configuration_reference_and_topics_are_current() -> None:
    ref = load("config_reference")
    doc = ref.DOC.read_text()
    assert ref.BEGIN in doc and ref.END in doc and ref.TOPICS_BEGIN in doc and ref.TOPICS_END in doc
    assert ref.update(doc) == doc, "run: uv run python scripts/config_reference.py"


def test_the_reference_lists_every_setting_with_a_meaning() -> None:
    ref = load("config_reference")
    section = ref.render()
    base = ref.load(ref.BASE)
    for var in ref.env_vars(base):
        assert f"`{var.name.replace('GPUAAS_SERVICE_', 'GPUAAS_<SERVICE>_')}`" in section
    for cls in [ref.load(ref.AGENT[1]), *(ref.service_class(s) for s in ref.SERVICES)]:
        for var in ref.env_vars(cls):
            if var.field not in base.model_fields:
                assert f"`{var.name}`" in section, var.name
            assert var.meaning, f"{cls.__module__}.{cls.__name__}.{var.field}: comment it where it is declared"


def test_every_meaning_written_in_the_script_names_a_real_setting() -> None:
    ref = load("config_reference")
    classes = [ref.load(ref.BASE), ref.load(ref.AGENT[1]), *(ref.service_class(s) for s in ref.SERVICES)]
    fields = {(ref.owner(c), f) for c in classes for f in c.__annotations__}
    stale = sorted(set(ref.MEANINGS) - fields)
    assert not stale, f"MEANINGS entries for settings that no longer exist: {stale}"


def test_the_chart_sets_only_variables_a_component_reads() -> None:
    ref = load("config_reference")
    check = load("chart_check")
    known = set().union(*ref.known_env_names().values()) | check.MIGRATE_ENV
    text = "\n".join(p.read_text() for p in TEMPLATES.glob("*.yaml"))
    literal = set(re.findall(r"\b(GPUAAS_[A-Z0-9_]+[A-Z0-9])\b", text))
    unknown = sorted(n for n in literal if n not in known)
    assert not unknown, f"the chart sets variables nothing reads: {unknown}"
    # `{{ $prefix }}NAME` is GPUAAS_<SERVICE>_NAME for every service: NAME must be a base setting.
    base = {f.upper() for f in ref.load(ref.BASE).model_fields}
    suffixes = set(re.findall(r"\{\{ \$prefix \}\}([A-Z_]+)", text))
    assert suffixes and suffixes <= base, sorted(suffixes - base)
