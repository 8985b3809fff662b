"""The node library (node.sh) on this machine's real Slurm, without the platform: two "allocations"
(distinct directories, munge daemons and ports), the controller stack with accounting, two slurmds,
a batch job to COMPLETED with its association, `srun -N2`, node removal with a slurmctld restart,
and verified teardown. Skipped with the reason when the host cannot run Slurm (no root, packages)."""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import subprocess
import uuid

import pytest

from gpuaas.slurm_reference.config import (
    Cluster,
    Node,
    cluster_id,
    node_dir,
    node_name,
    render_slurm_conf,
    render_slurmdbd_conf,
)
from gpuaas.slurm_reference.remote import LocalRunner, NodeError, script

NEEDED = ("munged", "slurmctld", "slurmd", "slurmdbd", "mariadbd", "sacctmgr")


def _cannot_run() -> str | None:
    if os.geteuid() != 0:
        return "needs root (munged/slurmctld/slurmd)"
    missing = [b for b in NEEDED if not shutil.which(b, path="/usr/sbin:/usr/bin:/sbin:/bin")]
    return f"missing {' '.join(missing)} (make install installs slurm-wlm)" if missing else None


def b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def test_precheck_fails_with_a_clear_reason_when_not_root() -> None:
    """A host where the allocation's sessions are not root: the member fails at once with the reason."""
    if os.geteuid() != 0:
        with pytest.raises(NodeError, match="cannot run Slurm"):
            asyncio.run(LocalRunner(str(uuid.uuid4()))(cluster_id(uuid.uuid4()), "precheck"))
        return
    out = subprocess.run(  # as root: drop to nobody for the check (setpriv, util-linux)
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "bash", "-s"],
        input=script("cx", "precheck"),
        capture_output=True,
        text=True,
        cwd="/",
        timeout=30,
    )
    assert out.returncode == 3
    assert "cannot run Slurm" in out.stdout and "uid" in out.stdout


def _tail(path: str, n: int = 1500) -> str:
    try:
        with open(path) as f:
            return f.read()[-n:]
    except OSError as exc:
        return str(exc)


async def test_real_slurm_cluster_on_two_allocations() -> None:
    reason = _cannot_run()
    if reason:
        pytest.skip(reason)
    iid = uuid.uuid4()
    cid = cluster_id(iid)
    a, b = str(uuid.uuid4()), str(uuid.uuid4())
    ra, rb = LocalRunner(a), LocalRunner(b)
    pre = await ra(cid, "precheck")
    ports = [int(p) for p in (await ra(cid, "free_ports 4"))["PORTS"].split(",")]
    wa, wb = uuid.uuid4(), uuid.uuid4()
    c = Cluster(
        instance_id=str(iid),
        cluster_id=cid,
        cluster_name="t" + iid.hex[:6],
        partition="gpu",
        account="acct1",
        controller_member_id=str(uuid.uuid4()),
        controller_allocation_id=a,
        ctld_hostname=pre["HOSTNAME"],
        ctld_addr="127.0.0.1",
        ctld_port=ports[0],
        dbd_port=ports[1],
        db_port=ports[2],
    )
    key = b64(os.urandom(1024))
    env = {"SLURM_CONF": f"{node_dir(a, cid)}/etc/slurm.conf", "PATH": "/usr/sbin:/usr/bin:/bin"}
    try:
        await ra(cid, "munge_up", MUNGE_KEY_B64=key)
        db = await ra(cid, "mariadb_up", DB_PORT=c.db_port, DB_PASS="pw-" + iid.hex[:8], timeout_s=180)
        assert db["MARIADB_VERSION"].startswith("10.")
        await ra(cid, "slurm_conf", SLURM_CONF_B64=b64(render_slurm_conf(c, a)))
        await ra(
            cid, "slurmdbd_up", SLURMDBD_CONF_B64=b64(render_slurmdbd_conf(c, "pw-" + iid.hex[:8])), DBD_PORT=c.dbd_port
        )
        await ra(cid, "accounting", CLUSTER_NAME=c.cluster_name, ACCOUNT=c.account, SLURM_USERS="root")
        # no worker yet: slurmctld starts on the FUTURE placeholder
        ctld = await ra(cid, "ctld_up", SLURM_CONF_B64=b64(render_slurm_conf(c, a)), CTLD_PORT=c.ctld_port, RESTART=0)
        assert ctld["SLURM_VERSION"].startswith("22.05")
        # worker 1 on the controller's allocation, worker 2 on allocation b (its own munged, same key)
        for member, runner, alloc, port in ((wa, ra, a, ports[3]), (wb, rb, b, None)):
            if port is None:
                port = int((await runner(cid, "free_ports 1"))["PORTS"])
            name = node_name(member)
            c.nodes[name] = Node(name, str(member), alloc, "127.0.0.1", pre["HOSTNAME"], port)
            await runner(cid, "munge_up", MUNGE_KEY_B64=key)
            await ra(cid, "ctld_up", SLURM_CONF_B64=b64(render_slurm_conf(c, a)), CTLD_PORT=c.ctld_port, RESTART=1)
            out = await runner(
                cid, "slurmd_up", SLURM_CONF_B64=b64(render_slurm_conf(c, alloc)), NODE=name, NODE_PORT=port
            )
            assert out["SLURMD_VERSION"].startswith("22.05")
        await ra(cid, "reconfigure")
        for name in c.nodes:
            for _ in range(60):
                state = (await ra(cid, "node_state", NODE=name))["STATE"]
                if state == "idle":
                    break
                await asyncio.sleep(0.5)
            assert state == "idle", (name, state)

        async def sh(cmd: str) -> str:
            proc = await asyncio.create_subprocess_exec(
                "bash", "-c", cmd, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
            )
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, (cmd, err.decode())
            return out.decode()

        job = (await sh("sbatch --parsable -o /dev/null --wrap 'hostname'")).strip()
        acct = ""
        for _ in range(60):
            acct = await sh(f"sacct -n -X -P -j {job} -o State,Account")
            if acct.startswith("COMPLETED"):
                break
            await asyncio.sleep(0.5)
        squeue = await sh("squeue -o '%i %T %r'")
        logs = [f"{node_dir(a, cid)}/log/slurmctld.log"] + [
            f"{node_dir(n.allocation_id, cid)}/log/slurmd-{n.name}.log" for n in c.nodes.values()
        ]
        assert acct.strip().splitlines()[0] == f"COMPLETED|{c.account}", (acct, squeue, [_tail(p) for p in logs])
        for _ in range(30):  # the usage producer's view: slurmdbd's completed jobs
            jd = await ra(cid, "jobs_done")
            if job in jd["JOBS"].split():
                break
            await asyncio.sleep(1)
        assert job in jd["JOBS"].split(), jd
        # PMIx: libpmix-dev lets Debian's mpi_pmix plugin load without the libpmix warnings
        pmix = await asyncio.create_subprocess_exec(
            "bash", "-c", "srun --mpi=pmix -N1 true", env=env, stderr=asyncio.subprocess.PIPE
        )
        _, pmix_err = await asyncio.wait_for(pmix.communicate(), 60)
        assert pmix.returncode == 0 and "libpmix" not in pmix_err.decode(), pmix_err.decode()
        both = await sh("srun -N2 bash -c 'echo $SLURMD_NODENAME'")
        assert sorted(both.split()) == sorted(c.nodes)

        # remove worker b: slurm.conf without it, slurmctld restarted, slurmd gone, port free
        gone = node_name(wb)
        port_b = c.nodes.pop(gone).port
        await ra(cid, "ctld_up", SLURM_CONF_B64=b64(render_slurm_conf(c, a)), CTLD_PORT=c.ctld_port, RESTART=1)
        out = await rb(cid, "teardown", ROLE="worker", NODE=gone)
        assert out["TEARDOWN_VERIFIED"] == "1", out
        assert str(port_b) in out["EVIDENCE"] and "removed" in out["EVIDENCE"]
        assert not os.path.exists(node_dir(b, cid))
        assert (await sh("sinfo -h -N -o '%N'")).split() == [node_name(wa)]
    finally:
        results = []
        with_ctl = await ra(cid, "teardown", ROLE="worker", NODE=node_name(wa))
        results.append(with_ctl)
        results.append(await ra(cid, "teardown", ROLE="controller"))
        with_b = await rb(cid, "teardown", ROLE="worker", NODE=node_name(wb))
        results.append(with_b)
    assert all(r["TEARDOWN_VERIFIED"] == "1" for r in results), results
    assert not os.path.exists(node_dir(a, cid)) and not os.path.exists(node_dir(b, cid))
    pgrep = await asyncio.create_subprocess_exec("pgrep", "-f", cid, stdout=asyncio.subprocess.PIPE)
    leftovers = (await pgrep.communicate())[0].decode()
    assert leftovers == "", leftovers
