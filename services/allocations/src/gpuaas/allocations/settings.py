"""Settings of the allocations service (env prefix `GPUAAS_ALLOCATIONS_`)."""

from gpuaas.kit.settings import ServiceSettings, service_config


class Settings(ServiceSettings):
    model_config = service_config("allocations")

    service_name: str = "allocations"
    port: int = 8002

    # Agents: how often they heartbeat, after how long without one a host is `unreachable`,
    # how long a leased task stays with an agent without progress, and the long-poll cap.
    agent_heartbeat_interval_s: float = 5.0
    agent_heartbeat_timeout_s: float = 30.0
    agent_task_lease_s: float = 60.0
    agent_long_poll_max_s: float = 25.0
    # Release saga: how long to wait for app-runtime's release clearance before releasing anyway
    # (recorded on the timeline as forced).
    release_clearance_timeout_s: float = 300.0
    reconcile_interval_s: float = 2.0
    # Capacity queue (issue 29): the admission loop runs on every wake-up (a release, a new queued request,
    # a host ready or uncordoned, a queue change) and at least this often (max_wait expiry, lost wake-ups).
    admission_resync_s: float = 2.0
    # Preemption with notice (issue 29): a queue below its guarantee may reclaim GPUs others borrowed. Only
    # guarantees trigger it (with none set anywhere nothing is ever preempted); false: never preempt.
    preemption_enabled: bool = True
    # A running allocation is never preempted before it has run this long.
    preemption_min_runtime_s: float = 600.0
    # The notice before the stop: event, timeline, /run/gpuaas/preemption in the allocation, its SSH sessions.
    preemption_grace_s: float = 120.0
    # At the deadline: SIGTERM, then SIGKILL after this many seconds (podman stop -t).
    preemption_stop_timeout_s: float = 10.0
    # Project overlays across hosts (issue 27): the IPv4 pool each project's /24 is cut from. Control planes whose
    # agents share a machine (two dev stacks) need disjoint pools (the devstack gives each running stack a /16).
    overlay_pool: str = "10.208.0.0/12"
    # The VXLAN id of the pool's first segment (segment i is base + i; disjoint per control plane, as the pool).
    overlay_vni_base: int = 0x100000
    # Browser terminal: lifetime of the platform's per-session SSH certificate.
    terminal_cert_ttl_s: int = 120
