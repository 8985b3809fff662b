"""gpuaas.app_runtime: App instances, members, member operations and the controller API."""

# The service's name: the SPEC's name and the `service` of its audit records.
SERVICE = "app_runtime"
# The `source` of its events and its system actor: hyphenated since the first release (consumers and the
# topic registry know it by this spelling), so it stays so.
EVENT_SOURCE = "app-runtime"
