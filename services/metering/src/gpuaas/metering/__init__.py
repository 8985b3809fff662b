"""gpuaas.metering: Meters and usage records from lifecycle events; the app usage producer API."""
