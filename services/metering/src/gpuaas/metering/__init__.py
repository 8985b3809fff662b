"""gpuaas.metering: Meters and usage records from lifecycle events; the app usage producer API."""

# The service's name, declared once: the SPEC's name, audit records' `service=`, events' `source=`.
SERVICE = "metering"
