"""gpuaas-metering."""
