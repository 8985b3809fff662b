"""gpuaas.node_agent: the host daemon that dials out to allocations (register, inventory, heartbeat,
tasks). Built with the allocations issue; the package exists so the workspace layout is complete."""
