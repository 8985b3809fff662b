"""gpuaas.allocations: GPU hosts, placement and the allocation lifecycle."""

# The service's name, declared once: the SPEC's name, audit records' `service=`, events' `source=`.
SERVICE = "allocations"
