"""The cluster's state and the Slurm configuration rendered from it (pure functions, no I/O).

The state (`cluster.json`) lives on the controller allocation, next to slurmctld: it is the source of
truth for which nodes exist, so a restarted controller replica (or another one) picks up where the
last one stopped. It holds no secret; the munge key and the database password stay on the hosts.

Static nodes: Slurm 22.05 reads `NodeName` lines only at slurmctld start, so adding or removing a
node rewrites slurm.conf everywhere, restarts slurmctld and then `scontrol reconfigure`s the slurmds.
slurmctld refuses to start with no node at all, so a cluster without workers carries one
`State=FUTURE` placeholder node (never scheduled, never shown as a worker).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

ROOT = "/var/lib/gpuaas-slurm"
SAFE = re.compile(r"[^a-z0-9-]")


def cluster_id(instance_id: uuid.UUID) -> str:
    """Directory key of an instance's cluster on every member allocation."""
    return "c" + instance_id.hex[:12]


def node_name(member_id: uuid.UUID) -> str:
    """A worker member's Slurm node name (stable across retries of the same operation)."""
    return "n" + member_id.hex[-10:]


def node_dir(allocation_id: uuid.UUID | str, cid: str) -> str:
    """Must match node.sh: the allocation id's last 12 hex digits keep Unix socket paths short."""
    return f"{ROOT}/{str(allocation_id).replace('-', '')[-12:]}/{cid}"


def slurm_cluster_name(config: dict[str, Any], instance_id: uuid.UUID) -> str:
    name = SAFE.sub("-", str(config.get("cluster_name") or "gpuaas").lower())[:32].strip("-") or "gpuaas"
    return name if name[0].isalpha() else "c" + name


@dataclass
class Node:
    name: str
    member_id: str
    allocation_id: str
    addr: str  # how slurmctld and srun reach the slurmd (the allocation's host address)
    hostname: str
    port: int
    cpus: int = 1
    memory_mb: int = 1024


@dataclass
class Cluster:
    instance_id: str
    cluster_id: str
    cluster_name: str
    partition: str
    account: str
    controller_member_id: str
    controller_allocation_id: str
    ctld_hostname: str
    ctld_addr: str
    ctld_port: int
    dbd_port: int
    db_port: int
    nodes: dict[str, Node] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Cluster:
        nodes = {k: Node(**v) for k, v in (data.get("nodes") or {}).items()}
        return cls(**{**data, "nodes": nodes})

    def node_of_member(self, member_id: uuid.UUID | str) -> Node | None:
        return next((n for n in self.nodes.values() if n.member_id == str(member_id)), None)

    def allocations(self) -> set[str]:
        return {self.controller_allocation_id, *(n.allocation_id for n in self.nodes.values())}


def render_slurm_conf(c: Cluster, allocation_id: str) -> str:
    """slurm.conf as seen from one allocation (paths are that allocation's; everything else is shared)."""
    d = node_dir(allocation_id, c.cluster_id)
    sock = f"{d}/munge/munge.sock"
    lines = [
        "# Written by the GPUaaS Slurm reference controller; edits are overwritten on the next membership change.",
        f"ClusterName={c.cluster_name}",
        f"SlurmctldHost={c.ctld_hostname}({c.ctld_addr})",
        f"SlurmctldPort={c.ctld_port}",
        "AuthType=auth/munge",
        f"AuthInfo=socket={sock}",
        "CredType=cred/munge",
        "SlurmUser=root",
        "SlurmdUser=root",
        # paths in this file are the allocation's own, so the files differ between allocations by design
        "DebugFlags=NO_CONF_HASH",
        f"StateSaveLocation={d}/state",
        f"SlurmdSpoolDir={d}/spool/%n",
        f"SlurmctldPidFile={d}/run/slurmctld.pid",
        f"SlurmdPidFile={d}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={d}/log/slurmctld.log",
        f"SlurmdLogFile={d}/log/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/linux",
        "JobAcctGatherFrequency=30",
        "AccountingStorageType=accounting_storage/slurmdbd",
        f"AccountingStorageHost={c.ctld_addr}",
        f"AccountingStoragePort={c.dbd_port}",
        # With munge, AccountingStoragePass names the munge socket used towards slurmdbd.
        f"AccountingStoragePass={sock}",
        "AccountingStorageEnforce=associations,limits",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "ReturnToService=2",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SlurmdTimeout=20",  # a dead slurmd shows DOWN within ~30 s (the controller then fails its member)
        "InactiveLimit=0",
        "KillWait=5",
        "MinJobAge=300",
    ]
    names = sorted(c.nodes)
    for name in names:
        n = c.nodes[name]
        lines.append(
            f"NodeName={n.name} NodeHostname={n.hostname} NodeAddr={n.addr} Port={n.port} "
            f"CPUs={n.cpus} RealMemory={n.memory_mb} State=UNKNOWN"
        )
    if not names:  # slurmctld will not start without any node: a placeholder that is never scheduled
        lines.append(f"NodeName={c.cluster_id}-none NodeAddr={c.ctld_addr} CPUs=1 State=FUTURE")
    part = f"PartitionName={c.partition} Default=YES MaxTime=INFINITE State=UP"
    lines.append(part + (f" Nodes={','.join(names)}" if names else ""))
    return "\n".join(lines) + "\n"


def render_slurmdbd_conf(c: Cluster, db_password: str) -> str:
    d = node_dir(c.controller_allocation_id, c.cluster_id)
    return (
        "\n".join(
            [
                "# Written by the GPUaaS Slurm reference controller.",
                "AuthType=auth/munge",
                f"AuthInfo=socket={d}/munge/munge.sock",
                f"DbdHost={c.ctld_hostname}",
                "DbdAddr=127.0.0.1",
                f"DbdPort={c.dbd_port}",
                "SlurmUser=root",
                f"LogFile={d}/log/slurmdbd.log",
                f"PidFile={d}/run/slurmdbd.pid",
                "StorageType=accounting_storage/mysql",
                "StorageHost=127.0.0.1",
                f"StoragePort={c.db_port}",
                "StorageUser=slurm",
                f"StoragePass={db_password}",
                "StorageLoc=slurm_acct_db",
            ]
        )
        + "\n"
    )


def access_bundle(c: Cluster, app_version: str) -> dict[str, Any]:
    """What a user needs to use the cluster from the controller allocation (shown in runtime_detail)."""
    d = node_dir(c.controller_allocation_id, c.cluster_id)
    conf = f"{d}/etc/slurm.conf"
    env = f"export SLURM_CONF={conf}"
    return {
        "login_allocation_id": c.controller_allocation_id,
        "slurm_conf": conf,
        "slurmdbd_conf": f"{d}/etc/slurmdbd.conf",
        "munge_socket": f"{d}/munge/munge.sock",
        "logs": f"{d}/log/",
        "env": {"SLURM_CONF": conf},
        "commands": {
            "sinfo": f"{env}; sinfo",
            "srun": f"{env}; srun -N{max(len(c.nodes), 1)} hostname",
            "sbatch": f"{env}; sbatch --wrap 'hostname; nvidia-smi -L || true'",
            "sacct": f"{env}; sacct -X -o JobID,JobName,Account,State,ExitCode",
            "squeue": f"{env}; squeue",
        },
        "health_examples": [
            f"{env}; scontrol ping",
            f"{env}; sinfo -R",
            f"{env}; sdiag | head -n 20",
            f"{env}; sacctmgr show assoc format=cluster,account,user",
        ],
        "pmix": "libpmix-dev is installed with Slurm, so `srun --mpi=pmix` loads without the libpmix warning;"
        " MpiDefault=none",
        "versions": {"app_version": app_version, **c.versions},
    }
