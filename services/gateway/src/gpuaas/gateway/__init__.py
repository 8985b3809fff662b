"""gpuaas-gateway."""
