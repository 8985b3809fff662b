"""gpuaas.app_runtime: App instances, members, member operations and the controller API."""
