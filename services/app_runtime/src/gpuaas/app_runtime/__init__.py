"""gpuaas-app-runtime."""
