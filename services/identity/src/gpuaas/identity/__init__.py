"""gpuaas-identity."""
