"""Allocations use cases. Each runs in the caller's ONE transaction: state + outbox events + audit.

The caller (the api/ routers, handlers.py, the reconciler) owns the transaction; nothing here commits or
talks to the network. Agent work is queued as rows of `agent_tasks` in the same transaction as the
state change that needs it, so a crash never leaves a state without its task or a task without
its state.

One module per area; this package re-exports the use cases, so callers write `service.create_allocation(...)`:

- `common`: the service's actor and clock, allocation rows with their volumes, versioned updates,
  checked transitions, timeline entries, agent task queueing, `load_allocation` (authorized read)
- `hosts`: operators' host management · `agents`: the node agent's registration and heartbeats
- `runtimes`: the catalog's runtime images (projection) and their resolution · `host_classes`: class
  figures, an allocation's runtime and limits
- `agent_tasks`: the agents' task queue and the outcome of each task kind
- `placement`: free capacity and GPU reservation · `quotas`: project GPU quotas
- `queues`: capacity queues (tenant and project, per GPU model) and their views · `queue_history`: each
  queue's share (held GPUs) over a window · `waiting`: requests queued
  for capacity (enqueue, position, cancel, max_wait) · `admission_runner`: one pool's admission cycle ·
  `preemption`: a victim's notice, its stop at the deadline (release or requeue), preemptions under way
- `lifecycle`: create, list, restart, resize, release · `timeline`: reading the timeline
- `access`: SSH keys and grants, authorized keys, the terminal's CA and access · `volumes`: storage

Reads answer contract states (`AllocationState`, `HostState`, `VolumeState`, `SshGrantState`) or the
view models of `gpuaas.allocations.views`; a change of an allocation answers an `AllocationChange`
(the body, the allocation's new version and the host whose agent has work).
"""

from gpuaas.allocations.service.access import (
    SYNCABLE,
    access_of_user_changed,
    add_ssh_key,
    apply_access_grant,
    authorized_keys,
    create_grant,
    delete_ssh_key,
    grant_state,
    list_grants,
    list_ssh_keys,
    open_terminal,
    revoke_grant,
    ssh_host_key,
    sync_keys,
    terminal_ca_private_key,
    terminal_still_allowed,
)
from gpuaas.allocations.service.agent_tasks import claim_tasks, complete_task, report_progress, requeue_expired_tasks
from gpuaas.allocations.service.agents import agent_host_id, heartbeat, mark_lost_hosts, register_agent
from gpuaas.allocations.service.common import SYSTEM, alloc_state, now
from gpuaas.allocations.service.host_classes import list_host_classes, put_host_class
from gpuaas.allocations.service.hosts import (
    cordon_host,
    enrol_host,
    enrol_host_unchecked,
    get_host,
    hash_token,
    host_state,
    list_hosts,
    reenrol_host,
    rotate_node_token,
    set_tenancy,
    uncordon_host,
)
from gpuaas.allocations.service.launch import launch_allocation, release_launch_allocation
from gpuaas.allocations.service.lifecycle import (
    LIVE_MEMBER,
    allocation_views,
    clearance_granted,
    create_allocation,
    enqueue_release,
    get_allocation,
    list_allocations,
    live_app_members,
    overdue_clearances,
    record_app_member,
    release_allocation,
    restart_allocation,
)
from gpuaas.allocations.service.queues import (
    get_project_queue,
    get_tenant_queue,
    list_queues,
    list_tenant_queues,
    put_project_queue,
    put_tenant_queue,
)
from gpuaas.allocations.service.quotas import get_quota, set_quota
from gpuaas.allocations.service.resizes import cancel_pending_resize, resize_allocation
from gpuaas.allocations.service.runtimes import (
    offered_runtimes,
    record_artifact,
    record_runtime_manifest,
    resolve_runtime,
)
from gpuaas.allocations.service.timeline import read_timeline, timeline_entries
from gpuaas.allocations.service.volumes import (
    attach_volume,
    create_volume,
    delete_volume,
    detach_volume,
    get_volume,
    list_volumes,
)

__all__ = [
    "LIVE_MEMBER",
    "SYNCABLE",
    "SYSTEM",
    "access_of_user_changed",
    "add_ssh_key",
    "agent_host_id",
    "alloc_state",
    "allocation_views",
    "apply_access_grant",
    "attach_volume",
    "authorized_keys",
    "cancel_pending_resize",
    "claim_tasks",
    "clearance_granted",
    "complete_task",
    "cordon_host",
    "create_allocation",
    "create_grant",
    "create_volume",
    "delete_ssh_key",
    "delete_volume",
    "detach_volume",
    "enqueue_release",
    "enrol_host",
    "enrol_host_unchecked",
    "get_allocation",
    "get_host",
    "get_project_queue",
    "get_quota",
    "get_tenant_queue",
    "get_volume",
    "grant_state",
    "hash_token",
    "heartbeat",
    "host_state",
    "launch_allocation",
    "list_allocations",
    "list_grants",
    "list_host_classes",
    "list_hosts",
    "list_queues",
    "list_ssh_keys",
    "list_tenant_queues",
    "list_volumes",
    "live_app_members",
    "mark_lost_hosts",
    "now",
    "offered_runtimes",
    "open_terminal",
    "overdue_clearances",
    "put_host_class",
    "put_project_queue",
    "put_tenant_queue",
    "read_timeline",
    "record_app_member",
    "record_artifact",
    "record_runtime_manifest",
    "reenrol_host",
    "register_agent",
    "release_allocation",
    "release_launch_allocation",
    "report_progress",
    "requeue_expired_tasks",
    "resize_allocation",
    "resolve_runtime",
    "restart_allocation",
    "revoke_grant",
    "rotate_node_token",
    "set_quota",
    "set_tenancy",
    "ssh_host_key",
    "sync_keys",
    "terminal_ca_private_key",
    "terminal_still_allowed",
    "timeline_entries",
    "uncordon_host",
]
