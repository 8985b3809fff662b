"""Allocations' HTTP surface, one router per audience: `users` (allocations, timeline, SSH keys and
grants, volumes, quotas), `terminal` (the users' browser terminal), `operators` (hosts), `runtimes`
(runtime images offered, host classes) and `agents` (the node agents, with their node token).
Request and response models live in `schemas`."""

from gpuaas.allocations.api import agents, operators, runtimes, terminal, users

routers = [users.router, operators.router, runtimes.router, terminal.router, agents.router]

__all__ = ["agents", "operators", "routers", "runtimes", "terminal", "users"]
