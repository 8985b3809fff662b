"""App-runtime use cases. Each runs in the caller's ONE transaction, writing state + outbox events + audit
record (+ timeline entries); the caller (a router, a handler or the reconciler) owns the transaction, and
nothing here commits or calls out on the network (custody's Vault calls run before or after, see
`credentials`). Use cases answer typed views (`views`) or contract states, never rows.

One module per area; this package re-exports the use cases, so callers write `service.deploy(...)`:

- `common`: loading (with authorization) and checked transitions of instances, members and operations,
  their events, timeline entries and audit records
- `deploy`: controller bindings, manifests, deploy, upgrade/rollback
- `operations`: member operation requests and the controller's leases (claim, heartbeat, complete, fail)
- `recovery`: operators' retry / cancel / force-fail of an operation
- `lifecycle`: controller reports, stop/start, decommission (verified or forced)
- `credentials`: access credentials (custody, the access grant, rotation, the controller's fetch)
- `release`: the release saga (members off a released allocation, then the clearance)
- `preemption`: a preemption notice drains the members on the allocation before its deadline
- `queries`: listings and the timeline
"""

from gpuaas.app_runtime.service.common import readable_instance
from gpuaas.app_runtime.service.credentials import (
    authorize_rotation,
    credential_for_controller,
    issue_credential,
    open_credential,
    public_credential,
    rotate_credential,
)
from gpuaas.app_runtime.service.deploy import authorize_deploy, bind_controller, deploy, upgrade
from gpuaas.app_runtime.service.lifecycle import (
    decommission,
    force_decommission,
    report_instance,
    report_member,
    start,
    stop,
)
from gpuaas.app_runtime.service.operations import (
    claim,
    complete,
    controller_fail,
    controller_operations,
    defer,
    expire_leases,
    heartbeat,
    request_operation,
)
from gpuaas.app_runtime.service.preemption import allocation_preemption_scheduled
from gpuaas.app_runtime.service.queries import (
    controller_event,
    controller_instances,
    controller_members,
    list_instances,
    list_members,
    list_operations,
    timeline_entries,
    timeline_since,
)
from gpuaas.app_runtime.service.recovery import cancel_operation, force_fail_operation, retry_operation
from gpuaas.app_runtime.service.release import allocation_release_requested, overdue_releases
from gpuaas.app_runtime.service.views import (
    ClaimView,
    ControllerBindingView,
    ControllerCredential,
    CredentialView,
    InstanceView,
    IssuedCredential,
    MemberView,
    OperationView,
    TimelineEntryView,
)

__all__ = [
    "ClaimView",
    "ControllerBindingView",
    "ControllerCredential",
    "CredentialView",
    "InstanceView",
    "IssuedCredential",
    "MemberView",
    "OperationView",
    "TimelineEntryView",
    "allocation_preemption_scheduled",
    "allocation_release_requested",
    "authorize_deploy",
    "authorize_rotation",
    "bind_controller",
    "cancel_operation",
    "claim",
    "complete",
    "controller_event",
    "controller_fail",
    "controller_instances",
    "controller_members",
    "controller_operations",
    "credential_for_controller",
    "decommission",
    "defer",
    "deploy",
    "expire_leases",
    "force_decommission",
    "force_fail_operation",
    "heartbeat",
    "issue_credential",
    "list_instances",
    "list_members",
    "list_operations",
    "open_credential",
    "overdue_releases",
    "public_credential",
    "readable_instance",
    "report_instance",
    "report_member",
    "request_operation",
    "retry_operation",
    "rotate_credential",
    "start",
    "stop",
    "timeline_entries",
    "timeline_since",
    "upgrade",
]
