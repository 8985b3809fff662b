"""gpuaas-kit."""
