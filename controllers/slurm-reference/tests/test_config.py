"""slurm.conf / slurmdbd.conf rendering and the access bundle (pure functions)."""

from __future__ import annotations

import uuid

from gpuaas.slurm_reference.config import (
    Cluster,
    Node,
    access_bundle,
    cluster_id,
    node_dir,
    node_name,
    render_slurm_conf,
    render_slurmdbd_conf,
    slurm_cluster_name,
)

A = "0190aaaa-bbbb-7ccc-8ddd-0123456789ab"
B = "0190aaaa-bbbb-7ccc-8ddd-ba9876543210"


def cluster(**kw: object) -> Cluster:
    iid = uuid.UUID("0190ffff-0000-7000-8000-000000000001")
    return Cluster(
        instance_id=str(iid),
        cluster_id=cluster_id(iid),
        cluster_name="acme",
        partition="gpu",
        account="p0190",
        controller_member_id=str(uuid.uuid4()),
        controller_allocation_id=A,
        ctld_hostname="vm",
        ctld_addr="127.0.0.1",
        ctld_port=40001,
        dbd_port=40002,
        db_port=40003,
        **kw,
    )


def test_paths_are_per_allocation_and_short() -> None:
    c = cluster()
    assert node_dir(A, c.cluster_id) == f"/var/lib/gpuaas-slurm/0123456789ab/{c.cluster_id}"
    assert node_dir(A, c.cluster_id) != node_dir(B, c.cluster_id)
    # slurmstepd's socket: <spool>/<node>/<node>_<job>.<step> must stay under 108 bytes
    sock = f"{node_dir(A, c.cluster_id)}/spool/{'n' * 11}/{'n' * 11}_9999999.4294967291"
    assert len(sock) < 108


def test_no_worker_means_a_future_placeholder_so_slurmctld_can_start() -> None:
    conf = render_slurm_conf(cluster(), A)
    assert "State=FUTURE" in conf
    assert "PartitionName=gpu Default=YES MaxTime=INFINITE State=UP\n" in conf  # no Nodes= yet


def test_nodes_ports_and_local_munge_socket() -> None:
    m1, m2 = uuid.uuid4(), uuid.uuid4()
    c = cluster()
    for m, alloc, port in ((m1, A, 41001), (m2, B, 41002)):
        c.nodes[node_name(m)] = Node(node_name(m), str(m), alloc, "127.0.0.1", "vm", port, cpus=2)
    on_a, on_b = render_slurm_conf(c, A), render_slurm_conf(c, B)
    assert "State=FUTURE" not in on_a
    assert f"NodeName={node_name(m1)} NodeHostname=vm NodeAddr=127.0.0.1 Port=41001 CPUs=2" in on_a
    assert f"Nodes={','.join(sorted([node_name(m1), node_name(m2)]))}" in on_a
    assert f"AuthInfo=socket={node_dir(A, c.cluster_id)}/munge/munge.sock" in on_a
    assert f"AuthInfo=socket={node_dir(B, c.cluster_id)}/munge/munge.sock" in on_b
    # with munge, AccountingStoragePass names the socket used towards slurmdbd
    assert f"AccountingStoragePass={node_dir(B, c.cluster_id)}/munge/munge.sock" in on_b
    assert "SlurmctldHost=vm(127.0.0.1)" in on_b and "SlurmctldPort=40001" in on_b
    assert "AccountingStorageEnforce=associations,limits" in on_a


def test_slurmdbd_conf_and_cluster_name() -> None:
    dbd = render_slurmdbd_conf(cluster(), "s3cret")
    assert "StoragePort=40003" in dbd and "DbdPort=40002" in dbd and "StoragePass=s3cret" in dbd
    iid = uuid.uuid4()
    assert slurm_cluster_name({"cluster_name": "My Cluster!"}, iid) == "my-cluster"
    assert slurm_cluster_name({}, iid) == "gpuaas"
    assert slurm_cluster_name({"cluster_name": "9lives"}, iid) == "c9lives"


def test_access_bundle_has_exact_paths_commands_and_honest_versions() -> None:
    c = cluster(versions={"slurmctld": "22.05.8", "munge": "0.5.15"})
    b = access_bundle(c, "1.0.0")
    conf = f"{node_dir(A, c.cluster_id)}/etc/slurm.conf"
    assert b["slurm_conf"] == conf and b["env"] == {"SLURM_CONF": conf}
    assert set(b["commands"]) >= {"sinfo", "srun", "sbatch", "sacct"}
    assert all(cmd.startswith(f"export SLURM_CONF={conf}; ") for cmd in b["commands"].values())
    assert any("scontrol ping" in h for h in b["health_examples"])
    assert b["versions"] == {"app_version": "1.0.0", "slurmctld": "22.05.8", "munge": "0.5.15"}
    assert Cluster.from_json(c.to_json()) == c


def test_member_address_prefers_the_project_network() -> None:
    from gpuaas.slurm_reference.adapter import member_address

    ep = {"host": "127.0.0.1", "port": 2222, "username": "bob"}
    container = {"ssh_endpoint": ep, "network": {"name": "gpuaas-p-1", "address": "10.89.0.5", "scope": "host"}}
    assert member_address(container) == "10.89.0.5"  # container host: the daemons listen in the allocation
    assert member_address({"ssh_endpoint": ep, "network": None}) == "127.0.0.1"  # process host: the host's
    assert member_address({"ssh_endpoint": ep, "network": {"name": "n", "address": None}}) == "127.0.0.1"
