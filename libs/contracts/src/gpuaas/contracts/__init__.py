"""gpuaas-contracts."""
