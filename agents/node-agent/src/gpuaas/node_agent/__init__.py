"""gpuaas-node-agent."""
