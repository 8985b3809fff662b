"""gpuaas-billing."""
