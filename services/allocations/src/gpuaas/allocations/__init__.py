"""gpuaas-allocations."""
