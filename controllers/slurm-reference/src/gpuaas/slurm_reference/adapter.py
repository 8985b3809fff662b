"""The Slurm reference adapter: member operations → real Slurm daemons on the member allocations.

Roles (the manifest's `roles`, `ROLES`): the first is the controller (munged, MariaDB, slurmdbd, slurmctld),
the second a worker (munged, slurmd), declared to come `after` the controller: the platform hands out a
worker's add once the controller is up, and on decommission removes the workers before the controller. A
worker may share the controller's allocation.

Every handler is idempotent: it reads what is already there (cluster.json on the controller
allocation, pid files and the munge key on each allocation) before it creates anything, so an
operation retried after a lost lease converges instead of doubling anything.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import os
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from gpuaas.sdk import ApiError, Client, Controller, OperationContext, OperationFailed, ReconcileContext, on
from gpuaas.sdk.controller import exec as sdk_exec
from gpuaas.sdk.models import Instance, Member
from gpuaas.slurm_reference.config import (
    Cluster,
    Node,
    access_bundle,
    cluster_id,
    node_name,
    render_slurm_conf,
    render_slurmdbd_conf,
    slurm_cluster_name,
)
from gpuaas.slurm_reference.remote import NodeError, Runner, SshRunner

log = logging.getLogger("gpuaas.slurm_reference")
CONTROLLER_KEYS = frozenset({"controller", "slurmctld"})
# The manifest roles this adapter expects (the catalog's slurm-reference manifest declares them): slurmd workers
# come up after the slurmctld controller and are taken away before it, so the platform hands out operations in
# that order and no handler waits for the controller.
ROLES = (
    {"key": "controller", "display_name": "Controller", "description": "slurmctld"},
    {"key": "worker", "display_name": "Worker", "description": "slurmd", "after": ["controller"]},
)
LIVE_INSTANCE = frozenset({"starting", "running", "degraded"})
READY_STATES = ("idle", "mixed", "allocated", "completing")

RunnerFactory = Callable[[Client, uuid.UUID, uuid.UUID, Callable[[str], Awaitable[None]] | None], Awaitable[Runner]]


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


async def ssh_runner(
    client: Client,
    instance_id: uuid.UUID,
    allocation_id: uuid.UUID,
    on_wait: Callable[[str], Awaitable[None]] | None,
) -> Runner:
    """SSH to the allocation's endpoint (public allocations API) with the instance's access credential."""
    try:  # the endpoint with the host key the platform pinned for it: the runner verifies the host
        endpoint = await sdk_exec.endpoint_of(client, allocation_id)
    except sdk_exec.AccessNotReady as exc:
        raise OperationFailed(str(exc)) from exc
    cred = await client.fetch_credential(instance_id)
    return SshRunner(endpoint, cred.private_key, on_wait=on_wait)


def member_address(alloc: dict[str, Any]) -> str:
    """How the other members reach this allocation's daemons: its address on the project network (container
    hosts: each allocation has its own network namespace), else the host's SSH endpoint address (process
    hosts: the daemons listen on the host itself)."""
    net = alloc.get("network") or {}
    if net.get("address"):
        return str(net["address"])
    return str((alloc.get("ssh_endpoint") or {}).get("host") or "")


class SlurmReference(Controller):
    def __init__(
        self,
        runner_factory: RunnerFactory = ssh_runner,
        *,
        health_every_s: float = 15.0,
        node_ready_timeout_s: float = 60.0,
    ) -> None:
        self.runner_factory = runner_factory
        self.reconcile_every_s = health_every_s  # the SDK's timer per instance: health, usage, rollouts
        self.node_ready_timeout_s = node_ready_timeout_s
        self._posted: set[str] = set()  # app usage idempotency keys already accepted

    @classmethod
    def from_env(cls) -> SlurmReference:
        """As `gpuaas-controller run` builds it: GPUAAS_HEALTH_EVERY_S sets the health timer."""
        return cls(health_every_s=float(os.environ.get("GPUAAS_HEALTH_EVERY_S", "15")))

    # ----------------------------------------------------------------------------------- plumbing

    async def _runner(self, ctx: OperationContext, allocation_id: uuid.UUID) -> Runner:
        return await self.runner_factory(ctx.client, ctx.operation.instance_id, allocation_id, ctx.progress)

    @staticmethod
    async def _node(runner: Runner, cid: str, action: str, **env: Any) -> dict[str, str]:
        try:
            return await runner(cid, action, **env)
        except NodeError as exc:
            raise OperationFailed(str(exc)) from exc

    @staticmethod
    async def _load(runner: Runner, cid: str) -> tuple[Cluster | None, str]:
        out = await runner(cid, "read_cluster")
        raw = base64.b64decode(out["CLUSTER_JSON"]) if out.get("CLUSTER_JSON") else b""
        sha = hashlib.sha256(raw).hexdigest() if raw else ""
        return (Cluster.from_json(json.loads(raw)) if raw else None), sha

    async def _update(
        self, runner: Runner, cid: str, change: Callable[[Cluster | None], Cluster | None]
    ) -> Cluster | None:
        """Read-modify-write of cluster.json, compare-and-swap on its hash (several replicas may run)."""
        for _ in range(10):
            current, sha = await self._load(runner, cid)
            new = change(current)
            if new is None:
                return current
            out = await runner(
                cid,
                "cas_cluster",
                EXPECTED_SHA=sha,
                CLUSTER_JSON_B64=_b64(json.dumps(new.to_json(), indent=1, sort_keys=True)),
            )
            if out.get("CAS") == "ok":
                return new
            await asyncio.sleep(0.2)
        raise OperationFailed("cluster.json changed under us ten times in a row")

    @staticmethod
    def _controller_member(members: list[Member]) -> Member | None:
        candidates = [m for m in members if m.component_key in CONTROLLER_KEYS and not m.tombstoned]
        return candidates[-1] if candidates else None

    @staticmethod
    def _is_controller(component_key: str | None) -> bool:
        return (component_key or "") in CONTROLLER_KEYS

    async def _push_conf(self, ctx: OperationContext, cluster: Cluster, skip: set[str]) -> None:
        """Write the new slurm.conf on every other allocation of the cluster (workers keep a copy)."""
        for alloc in sorted(cluster.allocations() - skip):
            runner = await self._runner(ctx, uuid.UUID(alloc))
            try:
                await runner(cluster.cluster_id, "slurm_conf", SLURM_CONF_B64=_b64(render_slurm_conf(cluster, alloc)))
            except NodeError as exc:  # an unreachable worker gets the file when it next joins
                log.warning("slurm_conf push to %s failed: %s", alloc, exc)

    async def _restart_ctld(self, ctx: OperationContext, ctl_runner: Runner, cluster: Cluster) -> dict[str, str]:
        """Slurm 22.05 reads static NodeName lines only at start: restart slurmctld on membership changes."""
        out = await self._node(
            ctl_runner,
            cluster.cluster_id,
            "ctld_up",
            SLURM_CONF_B64=_b64(render_slurm_conf(cluster, cluster.controller_allocation_id)),
            CTLD_PORT=cluster.ctld_port,
            RESTART=1,
        )
        await ctx.event("slurmctld_restarted", f"slurmctld restarted with {len(cluster.nodes)} node(s)")
        return out

    async def _publish(self, client: Client, instance: Instance, cluster: Cluster, health: dict[str, Any]) -> None:
        detail = {
            "cluster_name": cluster.cluster_name,
            "partition": cluster.partition,
            "account": cluster.account,
            "slurmctld": f"{cluster.ctld_addr}:{cluster.ctld_port}",
            "slurmdbd": f"{cluster.ctld_addr}:{cluster.dbd_port}",
            "nodes": [
                {"name": n.name, "member_id": n.member_id, "allocation_id": n.allocation_id, "port": n.port}
                for n in sorted(cluster.nodes.values(), key=lambda n: n.name)
            ],
            "access": access_bundle(cluster, instance.app_version),
            "app_version": instance.app_version,
            "runtime_version": f"Slurm {cluster.versions.get('slurmctld', 'unknown')}",
        }
        await client.report_instance(instance.instance_id, runtime_detail=detail, health=health)

    # ---------------------------------------------------------------------------------- add / recover

    # `add` per role; the SDK runs the same handler for `recover` and `replace` of that role.
    @on("add", role="controller")
    @on("add", role="slurmctld")
    async def _add_controller(self, ctx: OperationContext) -> dict[str, Any]:
        op = ctx.operation
        assert op.allocation_id is not None and op.target_member_id is not None
        instance = await ctx.instance()
        cid = cluster_id(instance.instance_id)
        runner = await self._runner(ctx, op.allocation_id)
        await ctx.progress("checking the host can run Slurm", 5)
        pre = await self._node(runner, cid, "precheck")
        existing, _ = await self._load(runner, cid)
        if existing is not None and existing.controller_member_id == str(op.target_member_id):
            cluster = existing  # a retried operation: keep the ports and nodes it chose
        else:
            ports = [int(p) for p in (await self._node(runner, cid, "free_ports 3"))["PORTS"].split(",")]
            ep_host = member_address(
                await ctx.client.request("GET", f"/api/allocations/allocations/{op.allocation_id}")
            )
            cluster = Cluster(
                instance_id=str(instance.instance_id),
                cluster_id=cid,
                cluster_name=slurm_cluster_name(instance.config, instance.instance_id),
                partition=str(instance.config.get("partition") or "gpu"),
                account="p" + instance.project_id.hex[:12],
                controller_member_id=str(op.target_member_id),
                controller_allocation_id=str(op.allocation_id),
                ctld_hostname=pre["HOSTNAME"],
                ctld_addr=ep_host,
                ctld_port=ports[0],
                dbd_port=ports[1],
                db_port=ports[2],
                nodes=existing.nodes if existing else {},
            )
        key = (await self._node(runner, cid, "read_munge_key")).get("MUNGE_KEY_B64") or _b64(os.urandom(1024))
        await ctx.progress("starting munged", 15)
        munge = await self._node(runner, cid, "munge_up", MUNGE_KEY_B64=key)
        await ctx.progress("starting MariaDB for accounting", 25)
        db_password = secrets.token_urlsafe(18)
        db = await self._node(runner, cid, "mariadb_up", DB_PORT=cluster.db_port, DB_PASS=db_password, timeout_s=180)
        await self._node(
            runner,
            cid,
            "slurm_conf",
            SLURM_CONF_B64=_b64(render_slurm_conf(cluster, cluster.controller_allocation_id)),
        )
        await ctx.progress("starting slurmdbd", 45)
        await self._node(
            runner,
            cid,
            "slurmdbd_up",
            SLURMDBD_CONF_B64=_b64(render_slurmdbd_conf(cluster, db_password)),
            DBD_PORT=cluster.dbd_port,
        )
        await ctx.progress("creating the cluster, account and user associations", 60)
        await self._node(
            runner, cid, "accounting", CLUSTER_NAME=cluster.cluster_name, ACCOUNT=cluster.account, SLURM_USERS="root"
        )
        await ctx.progress("starting slurmctld", 75)
        cluster.versions.update({"munge": munge.get("MUNGE_VERSION", ""), "mariadb": db.get("MARIADB_VERSION", "")})
        snapshot = cluster

        def put(current: Cluster | None) -> Cluster:
            if current is not None and current.controller_member_id == snapshot.controller_member_id:
                snapshot.nodes = current.nodes  # a worker may have joined meanwhile
            return snapshot

        cluster = await self._update(runner, cid, put) or cluster
        ctld = await self._node(
            runner,
            cid,
            "ctld_up",
            SLURM_CONF_B64=_b64(render_slurm_conf(cluster, cluster.controller_allocation_id)),
            CTLD_PORT=cluster.ctld_port,
            RESTART=0,
        )
        cluster.versions["slurmctld"] = ctld.get("SLURM_VERSION", "")
        cluster = await self._update(runner, cid, lambda c: self._with_versions(c, cluster.versions)) or cluster
        await ctx.event(
            "slurmctld_up",
            f"slurmctld {cluster.versions['slurmctld']} up on {cluster.ctld_addr}:{cluster.ctld_port} "
            f"(cluster {cluster.cluster_name}, accounting on slurmdbd:{cluster.dbd_port})",
        )
        await self._publish(ctx.client, instance, cluster, {"status": "healthy", "message": "slurmctld is UP"})
        ctx.member_detail.update(slurmctld=f"{cluster.ctld_addr}:{cluster.ctld_port}", cluster=cluster.cluster_name)
        return {
            "role": "controller",
            "cluster": cluster.cluster_name,
            "slurmctld": f"{cluster.ctld_addr}:{cluster.ctld_port}",
            "versions": cluster.versions,
        }

    @staticmethod
    def _with_versions(c: Cluster | None, versions: dict[str, str]) -> Cluster | None:
        if c is None:
            return None
        c.versions.update({k: v for k, v in versions.items() if v})
        return c

    async def _controller(self, ctx: OperationContext) -> tuple[Member, Runner, Cluster] | str:
        """The active controller member, a runner on its allocation and the cluster; else why there is none.
        Nothing waits here for the controller to come up: the manifest's role order (`worker` after
        `controller`, `ROLES`) has the platform hand out a worker's add only once no controller member is
        still coming up."""
        members = await ctx.client.controller_members(ctx.operation.instance_id)
        ctl = self._controller_member(members)
        if ctl is None or ctl.status != "active":
            return "no controller member" if ctl is None else f"the controller member is {ctl.status}"
        runner = await self._runner(ctx, ctl.allocation_id)
        cluster, _ = await self._load(runner, cluster_id(ctx.operation.instance_id))
        if cluster is None:
            return "the controller allocation has no cluster.json"
        return ctl, runner, cluster

    @on("add")  # any other role is a worker
    async def _add_worker(self, ctx: OperationContext) -> dict[str, Any]:
        op = ctx.operation
        assert op.allocation_id is not None and op.target_member_id is not None
        member_id = op.target_member_id
        name = node_name(member_id)
        worker = await self._runner(ctx, op.allocation_id)
        cid = cluster_id(op.instance_id)
        await ctx.progress(f"checking the host can run Slurm ({name})", 5)
        pre = await self._node(worker, cid, "precheck")
        found = await self._controller(ctx)
        if isinstance(found, str):  # failed, or being replaced: offered again once the instance changes
            ctx.defer(f"slurmctld is not up: {found}")
        _, ctl_runner, cluster = found
        stale = [
            n
            for n in cluster.nodes.values()
            if op.member_id and op.member_id != member_id and n.member_id == str(op.member_id)
        ]
        for old in stale:  # recovering a failed member: its node goes, the new member's node comes
            await ctx.progress(f"removing the failed node {old.name}", 15)
            with _suppress_node_error():
                old_runner = await self._runner(ctx, uuid.UUID(old.allocation_id))
                await old_runner(cid, "teardown", ROLE="worker", NODE=old.name, PORTS=str(old.port))
        node = cluster.nodes.get(name)
        if node is None or node.allocation_id != str(op.allocation_id):
            port = int((await self._node(worker, cid, "free_ports 1"))["PORTS"])
            alloc = await ctx.client.request("GET", f"/api/allocations/allocations/{op.allocation_id}")
            node = Node(
                name=name,
                member_id=str(member_id),
                allocation_id=str(op.allocation_id),
                addr=member_address(alloc),
                hostname=pre["HOSTNAME"],
                port=port,
                cpus=max(1, int(pre.get("CPUS") or 1)),
            )
        await ctx.progress(f"distributing the munge key to {name}", 25)
        key = (await self._node(ctl_runner, cid, "read_munge_key")).get("MUNGE_KEY_B64")
        if not key:
            raise OperationFailed("the controller allocation has no munge key: recover the controller first")
        await self._node(worker, cid, "munge_up", MUNGE_KEY_B64=key)
        stale_names = {o.name for o in stale}

        def join(current: Cluster | None) -> Cluster:
            if current is None:
                raise OperationFailed("the cluster disappeared from the controller allocation")
            for n in stale_names:
                current.nodes.pop(n, None)
            current.nodes[name] = node
            return current

        cluster = await self._update(ctl_runner, cid, join) or cluster
        await ctx.progress(f"restarting slurmctld with node {name}", 45)
        await self._restart_ctld(ctx, ctl_runner, cluster)
        await ctx.progress(f"starting slurmd {name}", 60)
        slurmd = await self._node(
            worker,
            cid,
            "slurmd_up",
            SLURM_CONF_B64=_b64(render_slurm_conf(cluster, str(op.allocation_id))),
            NODE=name,
            NODE_PORT=node.port,
        )
        await self._push_conf(ctx, cluster, {cluster.controller_allocation_id, str(op.allocation_id)})
        await self._node(ctl_runner, cid, "reconfigure")
        await ctx.progress(f"waiting for {name} to be idle", 80)
        state = await self._wait_ready(ctl_runner, cid, name)
        version = slurmd.get("SLURMD_VERSION", "")
        cluster.versions["slurmd"] = version
        cluster = await self._update(ctl_runner, cid, lambda c: self._with_versions(c, {"slurmd": version})) or cluster
        await ctx.event("node_joined", f"{name} joined partition {cluster.partition} ({state})", node=name)
        instance = await ctx.instance()
        await self._publish(ctx.client, instance, cluster, {"status": "healthy", "message": f"{name} {state}"})
        ctx.member_detail.update(node=name, slurmd_port=node.port, slurmd_version=version)  # → member.detail
        return {"role": "worker", "node": name, "state": state, "slurmd_version": version, "port": node.port}

    async def _wait_ready(self, ctl_runner: Runner, cid: str, name: str) -> str:
        deadline = time.monotonic() + self.node_ready_timeout_s
        state = ""
        while time.monotonic() < deadline:
            out = await self._node(ctl_runner, cid, "resume_node", NODE=name)
            state = out.get("STATE", "")
            if state.rstrip("*~#") in READY_STATES:
                return state
            await asyncio.sleep(1)
        raise OperationFailed(
            f"slurmd {name} did not become idle within {self.node_ready_timeout_s:.0f}s (state {state!r})"
        )

    # ----------------------------------------------------------------------------------- drain / remove

    async def drain(self, ctx: OperationContext) -> dict[str, Any]:
        op = ctx.operation
        if self._is_controller(op.component_key):
            raise OperationFailed("the controller cannot be drained; drain its workers or decommission")
        assert op.member_id is not None
        found = await self._controller(ctx)
        if isinstance(found, str):  # a remove's drain-first records this and removes the node anyway
            raise OperationFailed(f"the node cannot be drained: {found} (slurmctld is not up)")
        _, ctl_runner, _ = found
        name = node_name(op.member_id)
        out = await self._node(
            ctl_runner, cluster_id(op.instance_id), "drain_node", NODE=name, REASON=f"gpuaas drain {op.operation_id}"
        )
        return {"drained": True, "node": name, "slurm_state": out.get("STATE", "")}

    async def remove(self, ctx: OperationContext) -> dict[str, Any]:
        op = ctx.operation
        assert op.member_id is not None and op.allocation_id is not None
        cid = cluster_id(op.instance_id)
        evidence: list[str] = []
        controller = self._is_controller(op.component_key)
        name = node_name(op.member_id)
        if not controller:
            evidence += await self._leave(ctx, name)
        try:
            runner = await self._runner(ctx, op.allocation_id)
            out = await runner(cid, "teardown", ROLE="controller" if controller else "worker", NODE=name)
        except (NodeError, OperationFailed) as exc:
            return {"teardown_verified": False, "evidence": "; ".join([*evidence, f"teardown could not run: {exc}"])}
        verified = out.get("TEARDOWN_VERIFIED") == "1"
        evidence.append(out.get("EVIDENCE", ""))
        await ctx.event(
            "teardown_verified" if verified else "teardown_unverified",
            f"{'controller' if controller else name}: {out.get('EVIDENCE', '')}",
        )
        return {"teardown_verified": verified, "evidence": "; ".join(e for e in evidence if e), "node": name}

    async def _leave(self, ctx: OperationContext, name: str) -> list[str]:
        """Take a worker's node out of the cluster (slurm.conf everywhere, slurmctld restart)."""
        members = await ctx.client.controller_members(ctx.operation.instance_id)
        ctl = self._controller_member(members)
        if ctl is None or ctl.status not in ("active", "starting", "stopping", "draining"):
            return ["no live controller: node left with the cluster"]
        cid = cluster_id(ctx.operation.instance_id)
        try:
            ctl_runner = await self._runner(ctx, ctl.allocation_id)
            cluster, _ = await self._load(ctl_runner, cid)
            if cluster is None or name not in cluster.nodes:
                return [f"{name} not in slurm.conf"]
            with _suppress_node_error():
                await ctl_runner(cid, "drain_node", NODE=name, REASON="gpuaas remove")

            def leave(current: Cluster | None) -> Cluster | None:
                if current is None or name not in current.nodes:
                    return None
                current.nodes.pop(name)
                return current

            cluster = await self._update(ctl_runner, cid, leave) or cluster
            await self._restart_ctld(ctx, ctl_runner, cluster)
            await self._push_conf(ctx, cluster, {cluster.controller_allocation_id})
            instance = await ctx.instance()
            await self._publish(ctx.client, instance, cluster, {"status": "healthy", "message": f"{name} removed"})
            return [f"{name} removed from slurm.conf, slurmctld restarted"]
        except (NodeError, OperationFailed) as exc:
            return [f"slurmctld not updated: {exc}"]

    # ----------------------------------------------------------------------------------------- health

    async def reconcile(self, ctx: ReconcileContext) -> None:
        """On the SDK's timer per instance (`reconcile_every_s`) and when the instance changes."""
        client, instance = ctx.client, ctx.instance_snapshot
        if instance.desired_app_version:
            await client.report_instance(instance.instance_id, app_version=instance.desired_app_version)
        if instance.status not in LIVE_INSTANCE:
            return
        members = await client.controller_members(instance.instance_id)
        ctl = self._controller_member(members)
        if ctl is None or ctl.status != "active":
            return
        cid = cluster_id(instance.instance_id)
        try:
            runner = await self.runner_factory(client, instance.instance_id, ctl.allocation_id, None)
            cluster, _ = await self._load(runner, cid)
            out = await runner(cid, "health", timeout_s=30)
        except NodeError as exc:
            await client.report_instance(
                instance.instance_id, health={"status": "unhealthy", "message": f"controller unreachable: {exc}"}
            )
            return
        if cluster is None:
            return
        nodes = dict(part.split(":", 1) for part in out.get("NODES", "").split() if ":" in part)
        bad = {n: s for n, s in nodes.items() if n in cluster.nodes and s.rstrip("*~#") not in READY_STATES}
        if "is UP" not in out.get("PING", ""):
            health = {"status": "unhealthy", "message": f"slurmctld: {out.get('PING', '').strip()}"}
        elif bad:
            health = {
                "status": "degraded",
                "message": "nodes not ready: " + ", ".join(f"{n}={s}" for n, s in bad.items()),
            }
        else:
            health = {"status": "healthy", "message": f"slurmctld UP; {len(cluster.nodes)} node(s) ready"}
        await self._publish(client, instance, cluster, health)
        await self._report_nodes(client, instance, cluster, members, nodes)
        await self._report_jobs(client, instance, runner, cid)

    @staticmethod
    async def _report_nodes(
        client: Client, instance: Instance, cluster: Cluster, members: list[Member], states: dict[str, str]
    ) -> None:
        """Member status from Slurm: an active worker whose node is DOWN (slurmd dead, or set down by an admin)
        is reported `failed` with the node's state, so the instance shows `degraded` and `recover` rebuilds it."""
        live = {str(m.member_id): m for m in members if not m.tombstoned}
        for node in cluster.nodes.values():
            member = live.get(node.member_id)
            state = states.get(node.name, "")
            if member is None or member.status != "active" or not state.startswith(("down", "fail")):
                continue
            await client.report_member(
                member.member_id,
                status="failed",
                detail={"node": node.name, "slurm_state": state, "reason": f"Slurm reports node {node.name} {state}"},
            )
            await client.report_event(instance.instance_id, "node_down", f"{node.name} is {state}", node=node.name)

    async def _report_jobs(self, client: Client, instance: Instance, runner: Runner, cid: str) -> None:
        """App usage producer: one `requests` unit per completed Slurm job, idempotent per job id."""
        try:
            jobs = (await runner(cid, "jobs_done", timeout_s=30)).get("JOBS", "").split()
        except NodeError as exc:
            log.warning("jobs_done failed: %s", exc)
            return
        for job in jobs:
            key = f"slurm-{cid}-job-{job}"
            if key in self._posted:
                continue
            try:
                await client.request(
                    "POST",
                    "/api/metering/usage/app",
                    json={
                        "instance_id": str(instance.instance_id),
                        "unit": "requests",
                        "quantity": "1",
                        "idempotency_key": key,
                        "occurred_at": datetime.now(UTC).isoformat(),
                    },
                )
            except ApiError as exc:
                if exc.code != "idempotency_key_reused":
                    log.warning("app usage for job %s not recorded: %s", job, exc)
                    continue
            self._posted.add(key)


class _suppress_node_error:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> bool:
        return exc_type is not None and issubclass(exc_type, NodeError | OperationFailed)
