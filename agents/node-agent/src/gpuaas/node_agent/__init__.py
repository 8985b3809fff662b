"""gpuaas.node_agent: the host daemon. It dials out to allocations (register, heartbeat, long-poll
tasks, report progress), provisions per-allocation workspaces and serves their SSH endpoint."""

__version__ = "0.1.0"
