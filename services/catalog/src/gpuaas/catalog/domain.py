"""Catalog rules without I/O: the artifact lifecycle as a transition table with gates, manifest
validation (JSON Schemas for the manifest and the launchable OCI workload profile), and the
compatibility check of an app against an allocation."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from gpuaas.contracts.enums import CapacityShape
from gpuaas.contracts.events.catalog import AppArtifactKind, ArtifactKind, ArtifactLifecycle
from gpuaas.kit.problems import Conflict, Problem, Unprocessable

# FROM -> allowed TO. canary -> staged is the rollback.
TRANSITIONS: dict[ArtifactLifecycle, frozenset[ArtifactLifecycle]] = {
    ArtifactLifecycle.draft: frozenset({ArtifactLifecycle.staged}),
    ArtifactLifecycle.staged: frozenset({ArtifactLifecycle.canary}),
    ArtifactLifecycle.canary: frozenset({ArtifactLifecycle.active, ArtifactLifecycle.staged}),
    ArtifactLifecycle.active: frozenset({ArtifactLifecycle.deprecated}),
    ArtifactLifecycle.deprecated: frozenset({ArtifactLifecycle.retired}),
    ArtifactLifecycle.retired: frozenset(),
}

RECORDABLE_CHECKS = ("lint", "smoke")
STAGING_CHECKS = ("lint", "smoke")
SLUG_PATTERN = r"^[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?$"
VERSION_PATTERN = r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?$"

LAUNCHABLE_PROFILE_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://gpuaas.dev/schemas/launchable-oci-workload-profile.v1.json",
    "title": "Launchable OCI workload profile",
    "type": "object",
    "additionalProperties": False,
    "required": ["image"],
    "properties": {
        "image": {"type": "string", "description": "the artifact, pinned by digest (must equal artifact_ref)"},
        "command": {"type": "array", "items": {"type": "string"}, "maxItems": 64},
        "args": {"type": "array", "items": {"type": "string"}, "maxItems": 256},
        "workdir": {"type": "string", "pattern": "^/"},
        "user": {"type": "string", "maxLength": 64},
        "env": {
            "type": "object",
            "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
            "additionalProperties": {"type": "string"},
            "maxProperties": 128,
        },
        "ports": {
            "type": "array",
            "maxItems": 32,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "container_port"],
                "properties": {
                    "name": {"type": "string", "pattern": "^[a-z][a-z0-9-]{0,31}$"},
                    "container_port": {"type": "integer", "minimum": 1, "maximum": 65535},
                    "protocol": {"enum": ["tcp", "udp"]},
                    "http": {"type": "boolean"},
                },
            },
        },
        "resources": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "gpu_count": {"type": "integer", "minimum": 0, "maximum": 64},
                "cpu_millis": {"type": "integer", "minimum": 1},
                "memory_mb": {"type": "integer", "minimum": 1},
                "shm_mb": {"type": "integer", "minimum": 0},
            },
        },
        "volumes": {
            "type": "array",
            "maxItems": 32,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "mount_path"],
                "properties": {
                    "name": {"type": "string", "pattern": "^[a-z][a-z0-9-]{0,62}$"},
                    "mount_path": {"type": "string", "pattern": "^/"},
                    "read_only": {"type": "boolean"},
                },
            },
        },
        "auth": {
            "type": "object",
            "additionalProperties": False,
            "required": ["env"],
            "description": "the workload requires the platform's per-instance secret (issue 21): read from "
            "`env`, presented by the gateway as `<header>: <scheme> <secret>`",
            "properties": {
                "env": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                "header": {"type": "string", "pattern": "^[A-Za-z0-9-]{1,64}$"},
                "scheme": {"type": "string", "maxLength": 32},
            },
        },
        "healthcheck": {
            "type": "object",
            "additionalProperties": False,
            "required": ["port"],
            "properties": {
                "http_path": {"type": "string", "pattern": "^/"},
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                "initial_delay_s": {"type": "integer", "minimum": 0},
                "period_s": {"type": "integer", "minimum": 1},
            },
        },
    },
}

MANIFEST_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://gpuaas.dev/schemas/app-manifest.v1.json",
    "title": "App manifest",
    "type": "object",
    "additionalProperties": False,
    "required": ["slug", "display_name", "version", "artifact_kind", "artifact_ref"],
    "properties": {
        "slug": {"type": "string", "pattern": SLUG_PATTERN},
        "display_name": {"type": "string", "minLength": 1, "maxLength": 200},
        "description": {"type": "string", "maxLength": 4000},
        "version": {"type": "string", "pattern": VERSION_PATTERN, "description": "the app's own version (semver)"},
        "runtime_version": {
            "type": ["string", "null"],
            "minLength": 1,
            "maxLength": 100,
            "description": "what the app installs, e.g. 'Slurm 22.05'; shown separately from version",
        },
        "artifact_kind": {"enum": [k.value for k in AppArtifactKind]},
        "artifact_ref": {"type": "string", "minLength": 1, "maxLength": 512},
        "compatibility": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "requires_capacity_shape": {
                    "type": "array",
                    "items": {"enum": [s.value for s in CapacityShape]},
                    "minItems": 1,
                    "uniqueItems": True,
                },
                "min_gpu_count": {"type": "integer", "minimum": 0, "maximum": 64},
                "requires_exclusive_node": {"type": "boolean"},
                "multi_allocation": {"type": "boolean"},
            },
        },
        "runtime_profile": {"type": ["object", "null"]},
        "inputs": {"type": "object"},
        "roles": {
            "type": "array",
            "maxItems": 32,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["key"],
                "properties": {
                    "key": {"type": "string", "pattern": "^[a-z][a-z0-9_-]{0,31}$"},
                    "display_name": {"type": "string", "maxLength": 100},
                    "description": {"type": "string", "maxLength": 1000},
                    "after": {
                        "type": "array",
                        "maxItems": 32,
                        "uniqueItems": True,
                        "items": {"type": "string", "pattern": "^[a-z][a-z0-9_-]{0,31}$"},
                    },
                },
            },
        },
        "active": {"type": "boolean"},
    },
}

_MANIFEST_VALIDATOR = Draft202012Validator(MANIFEST_SCHEMA)
_PROFILE_VALIDATOR = Draft202012Validator(LAUNCHABLE_PROFILE_SCHEMA)


def _schema_errors(validator: Draft202012Validator, doc: Any, prefix: str = "") -> list[dict[str, str]]:
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    return [{"path": prefix + "/".join(str(p) for p in e.absolute_path), "message": e.message} for e in errors[:20]]


def check_role_order(roles: list[dict[str, Any]]) -> None:
    """`after` names other roles of the manifest, without a cycle (the runtime orders operations by it)."""
    after = {r["key"]: list(r.get("after") or []) for r in roles}
    for key, before in after.items():
        unknown = [b for b in before if b not in after or b == key]
        if unknown:
            raise Unprocessable(
                f"role {key!r} comes after {', '.join(map(repr, unknown))}, which is not another role",
                code="roles_invalid",
            )
    done: set[str] = set()
    while len(done) < len(after):
        ready = [k for k, before in after.items() if k not in done and set(before) <= done]
        if not ready:
            raise Unprocessable(
                f"the roles' `after` form a cycle: {', '.join(sorted(set(after) - done))}", code="roles_invalid"
            )
        done.update(ready)


def validate_manifest(doc: Any) -> dict[str, Any]:
    """Structural + semantic validation of a manifest document; returns it with defaults filled in.

    The artifact reference itself (digest pinning) is checked by `oci.parse_ref`."""
    errors = _schema_errors(_MANIFEST_VALIDATOR, doc)
    if errors:
        raise Unprocessable(
            "the manifest does not match the app manifest schema", code="manifest_invalid", errors=errors
        )
    m = dict(doc)
    m.setdefault("description", "")
    m.setdefault("runtime_version", None)
    m.setdefault("inputs", {"type": "object", "properties": {}})
    m.setdefault("roles", [])
    m.setdefault("runtime_profile", None)
    m.setdefault("active", False)
    compat = {
        "requires_capacity_shape": [CapacityShape.baremetal.value, CapacityShape.gpu_slice.value],
        "min_gpu_count": 1,
        "requires_exclusive_node": False,
        "multi_allocation": False,
        **(m.get("compatibility") or {}),
    }
    m["compatibility"] = compat
    kind = AppArtifactKind(m["artifact_kind"])

    inputs = m["inputs"]
    try:
        Draft202012Validator.check_schema(inputs)
    except SchemaError as exc:
        raise Unprocessable(
            f"`inputs` is not a valid JSON Schema: {exc.message}", code="inputs_schema_invalid"
        ) from None
    if inputs.get("type") != "object":
        raise Unprocessable("`inputs` must be a JSON Schema of an object (type: object)", code="inputs_schema_invalid")

    keys = [r["key"] for r in m["roles"]]
    if len(keys) != len(set(keys)):
        raise Unprocessable("role keys must be unique", code="roles_invalid")
    if kind is AppArtifactKind.controller and not keys:
        raise Unprocessable("a controller app must declare the member roles its adapter owns", code="roles_required")
    check_role_order(m["roles"])

    profile = m["runtime_profile"]
    if kind is AppArtifactKind.launchable and profile is None:
        raise Unprocessable(
            "a launchable app needs a runtime_profile (launchable OCI workload profile)",
            code="runtime_profile_required",
        )
    if profile is not None:
        if kind not in (AppArtifactKind.launchable, AppArtifactKind.oci):
            raise Unprocessable(
                f"a runtime_profile applies to launchable/oci apps, not {kind.value}",
                code="runtime_profile_not_applicable",
            )
        errors = _schema_errors(_PROFILE_VALIDATOR, profile, "runtime_profile/")
        if errors:
            raise Unprocessable(
                "runtime_profile does not match the launchable OCI workload profile schema",
                code="runtime_profile_invalid",
                errors=errors,
            )
        if profile["image"] != m["artifact_ref"]:
            raise Unprocessable(
                "runtime_profile.image must be the manifest's artifact_ref (the same digest-pinned reference)",
                code="runtime_profile_invalid",
            )
        gpus = (profile.get("resources") or {}).get("gpu_count")
        if gpus is not None and gpus > compat["min_gpu_count"]:
            raise Unprocessable(
                f"runtime_profile asks for {gpus} GPUs but compatibility.min_gpu_count is {compat['min_gpu_count']}",
                code="runtime_profile_inconsistent",
            )
    return m


def artifact_kind_for(app_kind: AppArtifactKind) -> ArtifactKind:
    return ArtifactKind.blob if app_kind is AppArtifactKind.blob else ArtifactKind.oci


def latest_checks(checks: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    latest: dict[str, dict[str, Any]] = {}
    for c in checks:
        latest[c["name"]] = c
    return latest


def check_transition(
    current: ArtifactLifecycle,
    target: ArtifactLifecycle,
    *,
    checks: list[dict[str, Any]],
    canary_tenants: list[Any],
    instances_using: int,
) -> None:
    """Raise a Problem (409) naming the unmet gate, or return when the move is allowed."""
    if target not in TRANSITIONS[current]:
        allowed = ", ".join(sorted(TRANSITIONS[current])) or "none (terminal)"
        raise Conflict(
            f"an artifact cannot move {current.value} → {target.value}; from {current.value}: {allowed}",
            code="transition_not_allowed",
        )
    if target is ArtifactLifecycle.staged and current is ArtifactLifecycle.draft:
        latest = latest_checks(checks)
        missing = [n for n in STAGING_CHECKS if not (latest.get(n) or {}).get("passed")]
        if missing:
            raise Conflict(
                f"staging needs passing recorded results of: {', '.join(missing)}",
                code="artifact_checks_missing",
                missing=missing,
            )
    if target is ArtifactLifecycle.canary and not canary_tenants:
        raise Conflict("a canary needs at least one tenant to expose it to", code="canary_tenants_required")
    if target is ArtifactLifecycle.retired and instances_using:
        raise Conflict(
            f"{instances_using} app instance(s) still use this digest; retire is refused until none does",
            code="artifact_in_use",
            instances=instances_using,
        )


# ---------------------------------------------------------------------------------- compatibility


@dataclass
class AllocationShape:
    capacity_shape: CapacityShape
    gpu_count: int
    exclusive_node: bool = False
    allocation_count: int = 1


@dataclass
class Verdict:
    compatible: bool
    deployable: bool
    reasons: list[dict[str, str]] = field(default_factory=list)


def compatibility_reasons(compat: dict[str, Any], shape: AllocationShape) -> list[dict[str, str]]:
    reasons: list[dict[str, str]] = []
    shapes = compat.get("requires_capacity_shape") or []
    if shape.capacity_shape.value not in shapes:
        reasons.append(
            {
                "code": "capacity_shape_unsupported",
                "message": f"the app runs on {', '.join(shapes)}, not {shape.capacity_shape.value}",
            }
        )
    need = int(compat.get("min_gpu_count", 0))
    if shape.gpu_count < need:
        reasons.append(
            {"code": "insufficient_gpus", "message": f"the app needs at least {need} GPU(s); {shape.gpu_count} offered"}
        )
    exclusive = shape.exclusive_node or shape.capacity_shape is CapacityShape.baremetal
    if compat.get("requires_exclusive_node") and not exclusive:
        reasons.append(
            {"code": "exclusive_node_required", "message": "the app needs a whole node (baremetal or exclusive)"}
        )
    if shape.allocation_count > 1 and not compat.get("multi_allocation"):
        reasons.append(
            {
                "code": "multi_allocation_unsupported",
                "message": f"the app runs in one allocation; {shape.allocation_count} were offered",
            }
        )
    return reasons


def offered_to(manifest: dict[str, Any], artifact: dict[str, Any], tenant_id: Any) -> str | None:
    """None when the manifest may be used by a new instance of this tenant, else the reason code."""
    if manifest["deprecated"]:
        return "manifest_deprecated"
    if manifest["active"] and artifact["state"] == ArtifactLifecycle.active.value:
        return None
    if artifact["state"] == ArtifactLifecycle.canary.value and str(tenant_id) in {
        str(t) for t in artifact["canary_tenants"]
    }:
        return None
    return "manifest_not_active"


NOT_OFFERED_MESSAGES = {
    "manifest_deprecated": "this app version is deprecated: existing instances continue, new ones are refused",
    "manifest_not_active": "this app version is not offered for new deployments",
    "not_entitled": "the tenant is not entitled to this app",
}


def problem(code: str, message: str, status: int = 422) -> Problem:
    return Problem(message, code=code, status=status, title="Invalid request")
