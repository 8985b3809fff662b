"""The golden path, entirely through the gateway, on the real stack with real Slurm.

1. Platform admin creates a tenant and its admin; two GPU hosts enrol (real node agents, run as root
   with the container driver: the allocations are containers of the `gpuaas-slurm` runtime and reach
   each other on their project's network; the process driver where podman is missing); SKUs
   are priced; the catalog's seed apps are registered, verified against a real OCI registry, promoted to
   active and entitled.
2. The tenant admin logs in, creates a project, adds two members, creates the controller's service
   account and binds it as the slurm-reference controller.
3. A member adds an SSH key and creates two allocations; their timelines end `active`; SSH works;
   an SSH grant lets the second member in with their own key.
4. The tenant admin deploys Slurm Reference into allocation A (controller + worker); the reference
   controller (a separate process, public API only) brings up real munged/MariaDB/slurmdbd/slurmctld/
   slurmd; over SSH `sinfo` shows the node idle and `sbatch` runs a job to COMPLETED; a worker is added
   on allocation B and `srun -N2` runs on both nodes; worker B is removed with verified teardown.
5. Metering shows GPU time for both allocations and the controller's app usage (one request per
   completed job); billing's tenant combined cost and the operator breakdown agree; nothing is charged
   twice.
6. Decommission → verified teardown of every member (no daemon left, ports free); both allocations are
   released (billing stops); host 2's agent fails its first release on purpose, so one allocation shows
   `release_failed` with the reason and `retry-release` releases it.
7. The audit log shows every step, each user action under its own correlation id.

The scenario runs against any running stack: `tests/e2e/test_golden_path.py` runs it on the test
session's stack, `make demo` (scripts/demo.py) against the stack of `make run`; it lives in the
devstack (not in tests/) because the demo must not depend on the test suites. Step timings are
printed and written to <stack root>/golden-path.json.
"""

from gpuaas.devstack.golden_path.actors import Target
from gpuaas.devstack.golden_path.scenario import golden_path

__all__ = ["Target", "golden_path"]
