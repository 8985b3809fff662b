"""Catalog use cases. Each runs in ONE transaction: state + outbox event + audit record commit together.

The caller (a router, the seed) owns the transaction; nothing here commits. Registry work (content
verification, signature checks) never runs inside a transaction: the `trust` flows do it first and
then open the one transaction of the artifact use case that records the result.

One module per area; this package re-exports the use cases, so callers write `service.list_apps(...)`:

- `views`: the typed views the use cases return · `common`: states and views from rows, row locks,
  checks, the event + audit pair
- `artifacts`: register, checks, lifecycle transitions, reads · `trust`: the registry-backed flows
- `manifests`: register, activate/deactivate, deprecate · `entitlements`: grant, revoke, list
- `browsing`: whose view a caller reads, apps offered to a tenant, compatibility, snapshots
"""

from gpuaas.catalog.service.artifacts import (
    artifact_history,
    get_artifact,
    list_artifacts,
    record_check,
    register_artifact,
    transition_artifact,
)
from gpuaas.catalog.service.browsing import check_compatibility, get_manifest, list_apps, reader_tenant, snapshot
from gpuaas.catalog.service.entitlements import grant_entitlement, list_entitlements, revoke_entitlement
from gpuaas.catalog.service.manifests import deprecate_manifest, register_manifest, set_manifest_active
from gpuaas.catalog.service.trust import promote_artifact, register_verified_artifact, reverify_artifact

__all__ = [
    "artifact_history",
    "check_compatibility",
    "deprecate_manifest",
    "get_artifact",
    "get_manifest",
    "grant_entitlement",
    "list_apps",
    "list_artifacts",
    "list_entitlements",
    "promote_artifact",
    "reader_tenant",
    "record_check",
    "register_artifact",
    "register_manifest",
    "register_verified_artifact",
    "reverify_artifact",
    "revoke_entitlement",
    "set_manifest_active",
    "snapshot",
    "transition_artifact",
]
