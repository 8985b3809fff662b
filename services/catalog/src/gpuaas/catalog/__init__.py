"""gpuaas.catalog: App manifests, artifact trust and promotion, entitlements."""

SERVICE = "catalog"
