"""Allocations' HTTP surface, one router per audience: `users` (allocations, timeline, SSH keys and
grants, volumes, quotas), `queues` (capacity queues: tenant, project, the operators' view), `terminal` (the
users' browser terminal), `operators` (hosts), `runtimes` (runtime images offered, host classes), `capacity`
(operators' capacity series and GPU occupancy) and `agents` (the node agents, with their node token).
Request and response models live in `schemas`."""

from gpuaas.allocations.api import agents, capacity, operators, queues, runtimes, terminal, users

routers = [
    users.router,
    queues.router,
    operators.router,
    capacity.router,
    runtimes.router,
    terminal.router,
    agents.router,
]

__all__ = ["agents", "capacity", "operators", "queues", "routers", "runtimes", "terminal", "users"]
