"""gpuaas-sdk."""
