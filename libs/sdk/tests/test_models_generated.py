"""`gpuaas.sdk.models` is generated from the services' OpenAPI documents: regenerating it from the services
as they are now gives the committed file (else a response model changed: run the script)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[3]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generate_sdk_models", ROOT / "scripts" / "generate_sdk_models.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_models_match_the_services_openapi() -> None:
    generator = _generator()
    assert generator.TARGET.read_text() == generator.render(), (
        "libs/sdk/src/gpuaas/sdk/models.py is stale: run `uv run --frozen python scripts/generate_sdk_models.py`"
    )


def test_models_keep_what_the_schema_cannot_say() -> None:
    from gpuaas.sdk.models import CredentialSecret, Operation

    assert CredentialSecret.model_fields["private_key"].repr is False
    assert isinstance(Operation.target_member_id, property)
