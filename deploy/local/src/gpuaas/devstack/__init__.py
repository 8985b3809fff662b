"""gpuaas-devstack."""
