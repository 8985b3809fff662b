"""`python -m gpuaas.<service> migrate` imports only the service's settings and models (gpuaas.kit.cli.run): what
it migrates must be exactly what the service's SPEC names, or a stack would start on a schema its app does not
expect. Every stack start in the suites runs the light path for real; this pins the convention it relies on."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

MIGRATING = ("identity", "allocations", "catalog", "app_runtime", "metering", "billing")


@pytest.mark.parametrize("service", MIGRATING)
def test_the_light_migrate_path_is_what_the_spec_names(service: str) -> None:
    package = f"gpuaas.{service}"
    spec = importlib.import_module(f"{package}.app").SPEC
    models = importlib.import_module(f"{package}.models")
    assert spec.settings_cls is importlib.import_module(f"{package}.settings").Settings
    assert spec.metadata is models.metadata
    assert spec.versions_dir == Path(models.__file__).parent / "migrations" / "versions"
    assert spec.versions_dir.is_dir() and any(spec.versions_dir.glob("*.py"))
    main = (Path(models.__file__).parent / "__main__.py").read_text()
    assert f'run("{package}")' in main
