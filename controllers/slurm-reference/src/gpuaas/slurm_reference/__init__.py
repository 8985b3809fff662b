"""GPUaaS Slurm reference app controller: real Slurm on member allocations, public API only."""

from gpuaas.slurm_reference.adapter import SlurmReference

__all__ = ["SlurmReference"]
__version__ = "1.0.0"
