"""gpuaas-catalog."""
