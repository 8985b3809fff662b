"""gpuaas.allocations: GPU hosts, placement and the allocation lifecycle."""
