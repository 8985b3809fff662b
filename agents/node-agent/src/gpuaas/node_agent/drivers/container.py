"""The container driver: one podman container per allocation, from a runtime image pinned by digest.

    name   gpuaas-<allocation_id>
    labels gpuaas.allocation=<id>, gpuaas.agent=<agent id>, gpuaas.spec=<hash of what it was made from>
    image  <registry>/runtimes/<slug>@sha256:<hex>, pulled by digest and checked against the payload
    user   --userns=auto: root inside is an unprivileged uid range on the host; the allocation's user
           (uid 1000 inside, created by the image's `gpuaas-init <username> 1000`) owns its home
    net    the project's network (project_network.py: an isolated podman bridge per project; members of
           the project reach each other, other projects and the host do not; the outside is reachable),
           or slirp4netns when the payload names no project (own user-mode network: the outside only)
    limits --cpus / --memory / --pids-limit from the payload's limits
    mounts home -> /home/<username>, each volume's directory -> its mount path; GPUs through CDI

Release goes by the container, never by anything the user can change inside: `podman rm -f`, then
the container is gone, its cgroups (recorded at start) are empty or absent, no process on the host is
in its PID namespace (recorded at start), no mount of its root filesystem is left and the state dir is
removed. The evidence says what was checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import signal
import time
import uuid
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from gpuaas.contracts.agent import OverlaySpec
from gpuaas.node_agent import cdi, overlay, safefs, workload
from gpuaas.node_agent.drivers.base import SESSION_MARK, Driver, DriverError, SessionCommand
from gpuaas.node_agent.firewall import EgressPolicy
from gpuaas.node_agent.podman import ContainerInfo, Podman, PodmanError
from gpuaas.node_agent.project_network import NetworkError, ProjectNetworks, network_name
from gpuaas.node_agent.workspace import Workspace

log = logging.getLogger("gpuaas.node_agent")
USER_UID = 1000  # the allocation's user inside its container (each container has its own user namespace)
USERNS_SIZE = 65536
INIT = "/usr/local/sbin/gpuaas-init"
SPEC_FORMAT = 3  # bump when the way a container is made changes: older containers are recreated
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
# sh picks bash where the image has it: `sh -c PICK gpuaas-shell -c CMD` or `... -i`
PICK_SHELL = 'if command -v bash >/dev/null 2>&1; then exec bash "$@"; fi; exec sh "$@"'
CGROUP_ROOT = Path("/sys/fs/cgroup")
# What a workload (and apt/dpkg run through sudo) needs of root's powers inside the container; podman's other
# defaults (SETFCAP, SETPCAP, SYS_CHROOT, MKNOD, NET_RAW, AUDIT_WRITE) are dropped.
CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "NET_BIND_SERVICE", "SETGID", "SETUID")
# no-new-privileges stops setuid sudo: sudo_broker.py, mounted over the sudo the sessions' PATH finds first,
# asks the container's PID 1 (the broker, root of the container) instead.
SUDO = "/usr/local/bin/sudo"


def container_name(allocation_id: str) -> str:
    return f"gpuaas-{allocation_id}"


def _segment(ws: Workspace) -> OverlaySpec | None:
    """The allocation's place on its project's overlay (its task's `overlay`), if it has an address there."""
    raw = ws.meta.get("overlay")
    segment = OverlaySpec.model_validate(raw) if raw else None
    return segment if segment is not None and segment.address is not None else None


def _host_base(mapping: list[str] | None) -> int | None:
    """Host uid of uid 0 inside, from podman's "0:<host>:<size>" mapping."""
    for entry in mapping or []:
        inside, host, _ = (int(x) for x in entry.split(":"))
        if inside == 0:
            return host
    return None


def _pidns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _ticks_now() -> int:
    """Now, in the clock of /proc/<pid>/stat's start time (clock ticks since boot)."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK")) + 1


def _start_ticks(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _cgroups(pid: int) -> list[str]:
    out: list[str] = []
    try:
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            name = controllers.removeprefix("name=") or "unified"
            if path not in ("", "/"):
                out.append(str(CGROUP_ROOT / name / path.lstrip("/")))
    except OSError:
        pass
    return out


class ContainerDriver(Driver):
    name = "container"
    isolates_tenants = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.podman = Podman(self.s.podman, self.s.containers_conf, tls_verify=not self.s.registry_insecure)
        self._cdi_kind: str | None = None
        self._cdi_indices: set[int] = set()
        self._verified: set[str] = set()
        self.networks = ProjectNetworks(self.podman, EgressPolicy.build(self.s.egress_allow, self.s.egress_resolvers))

    # --------------------------------------------------------------------------------------- parts

    async def ensure_image(self, runtime: dict[str, Any] | None) -> str:
        """The local image for the payload's runtime, pulled by digest; refuses content that does not match."""
        if not runtime or not runtime.get("image") or not runtime.get("digest"):
            raise DriverError("this host runs the container driver and the task names no runtime image")
        image, digest = str(runtime["image"]), str(runtime["digest"])
        if not DIGEST.match(digest) or not image.endswith("@" + digest):
            raise DriverError(f"runtime image {image!r} is not pinned by its digest {digest!r}")
        if image in self._verified:
            return image
        have = await self.podman.image_digests(image)
        if have is None:
            try:  # podman checks the manifest against the digest in the reference and every blob against its digest
                await self.podman.pull(image)
            except PodmanError as exc:
                raise DriverError(f"runtime image {image} could not be pulled: {exc}") from exc
            have = await self.podman.image_digests(image)
        if not have or digest not in have:
            found = sorted(have or [])
            raise DriverError(f"runtime image {image} has digests {found}, not the pinned {digest}: refused")
        self._verified.add(image)  # local image storage is root's: checked once per agent run
        return image

    def _devices(self, ws: Workspace) -> list[str]:
        indices = ws.gpu_indices
        if not indices:
            return []
        if self.inventory.source == "nvidia-smi" and cdi.nvidia_spec_present():
            return [f"{cdi.NVIDIA_KIND}={i}" for i in indices]
        if self.inventory.source == "nvidia-smi":
            raise DriverError("the host has NVIDIA GPUs but no CDI spec: run `nvidia-ctk cdi generate`")
        if self._cdi_kind is None or not set(indices) <= self._cdi_indices:
            self._cdi_indices = {g.index for g in self.inventory.gpus} | set(indices)
            self._cdi_kind = cdi.write_fake_spec(self.s.cdi_dir, self.agent_id, sorted(self._cdi_indices))
        return [f"{self._cdi_kind}={i}" for i in indices]

    def _spec(self, ws: Workspace, image: str) -> tuple[list[str], str]:
        meta = ws.meta
        user = ws.username
        if not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", user):
            raise DriverError(f"username {user!r} is not a valid account name")
        address = (segment := _segment(ws)) and segment.address
        member = ["--ip", str(address), "--mac-address", overlay.member_mac(address)] if address else []
        args = [
            "--userns",
            f"auto:size={USERNS_SIZE}",
            "--network",
            network_name(meta.get("project_id")) or "slirp4netns",
            *member,  # the address the allocations service gave it on the project's overlay (kept for its life)
            "--hostname",
            self.hostname(ws),
            "--env",
            f"CUDA_VISIBLE_DEVICES={ws.cuda_visible_devices()}",
            "--volume",
            f"{ws.home}:/home/{user}:rw,nosuid,nodev",
            "--cap-drop",
            "all",
            "--cap-add",
            ",".join(CAPABILITIES),
            "--security-opt",
            "no-new-privileges",
            "--volume",
            f"{self._sudo_file()}:{SUDO}:ro",
        ]
        limits: dict[str, Any] = meta.get("limits") or {}  # AllocationLimits, as the task gave it
        args += ["--pids-limit", str(int(limits.get("pids") or 4096))]
        if limits.get("cpus"):
            args += ["--cpus", f"{float(limits['cpus']):g}"]
        if limits.get("memory_mb"):
            mem = f"{int(limits['memory_mb'])}m"
            args += ["--memory", mem, "--memory-swap", mem]
        for v in ws.volumes:
            target = "/" + "/".join(safefs.path_parts(v["mount_path"]))
            if target in ("/", f"/home/{user}") or target.startswith(("/proc", "/sys", "/dev")):
                raise DriverError(f"volume mount path {v['mount_path']!r} is not allowed")
            args += ["--volume", f"{self.workspaces.volume_dir(v['volume_id'])}:{target}:rw,nosuid,nodev"]
        for dev in self._devices(ws):
            args += ["--device", dev]
        if (spec := workload.spec_of(meta)) is not None:  # a launchable app's workload (issue 21)
            args += workload.container_args(spec, str(meta.get("workload_token") or ""), self._workload_bind(), user)
        spec_hash = hashlib.sha256(json.dumps([SPEC_FORMAT, image, user, args]).encode()).hexdigest()[:16]
        return args, spec_hash

    async def _run(self, ws: Workspace, image: str, args: list[str], spec_hash: str) -> None:
        """Create and start the container (`podman run -d`), hand the home to its user, create the user."""
        name = container_name(ws.allocation_id)
        labels = [f"gpuaas.allocation={ws.allocation_id}", f"gpuaas.agent={self.agent_id}", f"gpuaas.spec={spec_hash}"]
        label_args = [x for label in labels for x in ("--label", label)]
        # The container's command creates the user, then idles: no `podman exec` round trip, and a restart
        # runs it again (idempotent). _wait_user() sees from the host side when it is done.
        # PID 1 is the sudo broker: it idles until SIGTERM, or runs the workload and ends with it.
        command = ["/bin/sh", "-c", f'{INIT} "$0" "$1" && exec {SUDO} --gpuaas-serve "$1"', ws.username, str(USER_UID)]
        if (spec := workload.spec_of(ws.meta)) is not None:
            command = [SUDO, "--gpuaas-serve", str(USER_UID), "--", *workload.command(spec, ws.username, USER_UID)]
        network = network_name(ws.meta.get("project_id"))
        try:  # --pull=never: images come only through ensure_image's checked pull
            async with self._network(network, _segment(ws)):
                await self.podman.run("run", "-d", "--pull=never", "--name", name, *label_args, *args, image, *command)
        except PodmanError as exc:
            self._verified.discard(image)  # re-checked next time (e.g. removed from local storage meanwhile)
            if "already in use" not in str(exc):  # (an existing container is _ensure's to look at)
                # A failed `podman run` can leave the container Created, holding its address and network.
                with contextlib.suppress(PodmanError):
                    await self.podman.remove(name)
                await self._drop_network(network)
            raise
        try:
            info = await self.podman.inspect(name) or {}
            mappings = info.get("HostConfig", {}).get("IDMappings", {})
            uid0, gid0 = _host_base(mappings.get("UidMap")), _host_base(mappings.get("GidMap"))
            if uid0 is None or gid0 is None or uid0 == 0:
                raise DriverError(f"container {name} did not get its own user namespace ({mappings})")
            self._record_anchors(ws, info)
            owner = (uid0 + USER_UID, gid0 + USER_UID)
            if ws.meta.get("host_owner") != list(owner):  # a new uid range (first run, recreate): hand files over
                await asyncio.to_thread(safefs.chown_tree, ws.root, "home", *owner)
                for v in ws.volumes:
                    await asyncio.to_thread(safefs.chown_tree, self.workspaces.volumes_root, v["volume_id"], *owner)
                ws.write_meta(host_owner=list(owner))
            await self._wait_user(ws, info)
        except BaseException:
            await self._remove(ws, existed=True)
            raise

    def _sudo_file(self) -> Path:
        """The broker/client script on the host, bind-mounted read-only into every container."""
        path = Path(self.s.state_dir).resolve() / "sudo-broker"
        source = (Path(__file__).parent.parent / "sudo_broker.py").read_bytes()
        if not path.is_file() or path.read_bytes() != source:
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(source)
            tmp.chmod(0o755)  # root inside the container is an unprivileged host uid: it reads and runs it
            tmp.replace(path)
        return path

    @contextlib.asynccontextmanager
    async def _network(self, network: str | None, segment: OverlaySpec | None = None) -> AsyncGenerator[None, None]:
        """The project's network exists (contained: firewall.py) while a container is attached to it."""
        if network is None:
            yield
            return
        async with self.networks.locked(network):
            try:
                await self.networks.ensure(network, segment)
            except (NetworkError, PodmanError) as exc:
                raise DriverError(str(exc)) from exc
            yield

    async def _drop_network(self, network: str | None) -> None:
        if network is None:
            return
        try:
            async with self.networks.locked(network):
                await self.networks.remove_if_unused(network)
        except (NetworkError, PodmanError, OSError) as exc:  # the next release or agent start tries again
            log.warning("project network %s not removed: %s", network, exc)

    async def sync_overlay(self, project_id: str, segment: OverlaySpec) -> int | None:
        network = network_name(project_id)
        if network is None:
            return None
        try:
            async with self.networks.locked(network):
                return await self.networks.join_overlay(network, segment)
        except (NetworkError, PodmanError) as exc:
            raise DriverError(str(exc)) from exc

    async def _join_overlay(self, ws: Workspace) -> None:
        """After a start: the bridge in the project's segment, the names in every member's /etc/hosts (podman
        writes the file afresh when it starts a container)."""
        segment, project = _segment(ws), ws.meta.get("project_id")
        if segment is not None and project:
            await self.sync_overlay(str(project), segment)

    @staticmethod
    def hostname(ws: Workspace) -> str:
        # The id's random tail, not its head: ids are time-ordered (UUIDv7), so allocations created within a
        # minute share their first 8 hex digits (issue 33: four members of one project were all gpuaas-01a21c68).
        return f"gpuaas-{uuid.UUID(ws.allocation_id).hex[-12:]}"

    async def network_info(self, ws: Workspace) -> dict[str, Any] | None:
        """Where the allocation's project members reach it: {name, address, hostname, scope}."""
        network = network_name(ws.meta.get("project_id"))
        if network is None:
            return None
        address = await self.networks.address(container_name(ws.allocation_id), network)
        scope = "project" if _segment(ws) else "host"  # across the project's hosts, or this host's only
        return {"name": network, "address": address, "hostname": self.hostname(ws), "scope": scope}

    async def _wait_user(self, ws: Workspace, info: ContainerInfo, timeout_s: float = 60) -> None:
        """Until gpuaas-init has finished: its last step writes /etc/sudoers.d/gpuaas-<user>, seen in the
        container's root filesystem from the host (lexists: nothing there is followed). Without a rootfs path
        (another storage driver) the agent runs gpuaas-init itself."""
        name = container_name(ws.allocation_id)
        rootfs = (info.get("GraphDriver", {}).get("Data", {}) or {}).get("MergedDir")
        if not rootfs or not os.path.isdir(rootfs):
            await self.podman.exec(name, INIT, ws.username, str(USER_UID))
            return
        marker = os.path.join(rootfs, "etc", "sudoers.d", f"gpuaas-{ws.username}")
        deadline = time.monotonic() + timeout_s
        next_check = time.monotonic() + 1
        while not os.path.lexists(marker):
            if time.monotonic() > next_check:  # still running? gpuaas-init exits the container when it fails
                state = ((await self.podman.inspect(name)) or {}).get("State", {})
                if not state.get("Running"):
                    _, logs, err = await self.podman.run("logs", "--tail", "5", name, check=False)
                    raise DriverError(f"gpuaas-init failed in {name}: {(logs + err).strip()[-300:]}")
                next_check = time.monotonic() + 1
            if time.monotonic() > deadline:
                raise DriverError(f"gpuaas-init did not finish in {name} within {timeout_s:.0f}s")
            await asyncio.sleep(0.02)

    async def _start(self, ws: Workspace, verb: str) -> None:
        """Start (or restart) an existing container; its processes and namespaces are new ones."""
        name = container_name(ws.allocation_id)
        await self.podman.run(*(("restart", "-t", "0") if verb == "restart" else ("start",)), name)
        info = await self.podman.inspect(name) or {}
        self._record_anchors(ws, info)
        await self._wait_user(ws, info)

    async def _remove(self, ws: Workspace, existed: bool | None = None) -> None:
        """Remove the container and note when (the PID namespace check below needs the time)."""
        if existed is None:
            existed = await self.podman.exists(container_name(ws.allocation_id))
        await self.podman.remove(container_name(ws.allocation_id))
        await self._drop_network(network_name(ws.meta.get("project_id")) if ws.root.exists() else None)
        if ws.root.exists():
            anchors: dict[str, Any] = dict(ws.meta.get("anchors") or {})
            if existed or not anchors.get("removed_at"):
                anchors["removed_at"] = _ticks_now()
            ws.write_meta(anchors=anchors)

    def _record_anchors(self, ws: Workspace, info: ContainerInfo) -> None:
        """What release verifies against, read from the host side only (pid, namespace, cgroups, mounts)."""
        pid = int(info.get("State", {}).get("Pid") or 0)
        graph = info.get("GraphDriver", {}).get("Data", {}) or {}
        anchors: dict[str, Any] = dict(ws.meta.get("anchors") or {})
        anchors.pop("removed_at", None)
        anchors.update(
            container_id=info.get("Id"),
            pidns=_pidns(pid) if pid else anchors.get("pidns"),
            cgroups=sorted(set(_cgroups(pid)) | set(anchors.get("cgroups") or [])) if pid else anchors.get("cgroups"),
            rootfs=graph.get("MergedDir"),
        )
        ws.write_meta(anchors=anchors)

    async def _ensure(self, ws: Workspace, *, restart: bool = False) -> str:
        image = await self.ensure_image(ws.meta.get("runtime"))
        args, spec_hash = self._spec(ws, image)
        name = container_name(ws.allocation_id)
        if not ws.meta.get("anchors") and not restart:  # never started here: skip the look-up (one round trip)
            try:
                await self._run(ws, image, args, spec_hash)
                return f"container {name} created from {image}"
            except PodmanError as exc:
                if "already in use" not in str(exc):
                    raise
        info = await self.podman.inspect(name)
        current = ((info or {}).get("Config", {}).get("Labels") or {}).get("gpuaas.spec")
        if info is None or current != spec_hash:
            if info is not None:
                await self._remove(ws, existed=True)
            await self._run(ws, image, args, spec_hash)
            return f"container {name} created from {image}"
        if restart or not info.get("State", {}).get("Running"):
            await self._start(ws, "restart" if restart else "start")
            return f"container {name} {'restarted' if restart else 'started'}"
        return f"container {name} already running"

    def _workload_bind(self) -> str:
        return self.s.ssh_bind  # the address the host is enrolled with (the gateway's only upstream)

    async def workload_endpoint(self, ws: Workspace) -> dict[str, Any] | None:
        """After provision/restart: the workload's published host port once its health check answered."""
        spec = workload.spec_of(ws.meta)
        if spec is None:
            return None
        name = container_name(ws.allocation_id)
        port = workload.published_port(await self.podman.inspect(name) or {}, spec)
        if port is None:
            raise DriverError(f"container {name} publishes no port for its workload")

        async def running() -> bool:
            return bool(((await self.podman.inspect(name)) or {}).get("State", {}).get("Running"))

        async def logs() -> str:
            _, out, err = await self.podman.run("logs", "--tail", "5", name, check=False)
            return (out + err).strip()[-400:]

        token = str(ws.meta.get("workload_token") or "")
        try:
            url = workload.health_url(spec, self._workload_bind(), port)
            took = await workload.wait_healthy(url, workload.auth_headers(spec, token), running, logs)
        except workload.WorkloadFailed as exc:
            raise DriverError(str(exc)) from exc
        return {"host_port": port, "healthy": True, "health_s": round(took, 2)}

    # ----------------------------------------------------------------------------------- interface

    async def provision(self, ws: Workspace) -> str:
        try:
            message = await self._ensure(ws)
        except PodmanError as exc:
            raise DriverError(str(exc)) from exc
        await self._join_overlay(ws)
        return message

    async def restart(self, ws: Workspace) -> str:
        try:
            message = await self._ensure(ws, restart=True)
        except PodmanError as exc:
            raise DriverError(str(exc)) from exc
        await self._join_overlay(ws)
        return message

    async def apply(self, ws: Workspace, dropped_mounts: list[str]) -> str:
        return await self.provision(ws)  # a changed spec recreates the container; the same one is kept

    async def release(self, ws: Workspace) -> dict[str, Any]:
        name = container_name(ws.allocation_id)
        info = await self.podman.inspect(name)
        if info is not None and ws.root.exists():
            self._record_anchors(ws, info)
        try:
            await self._remove(ws, existed=info is not None)
        except PodmanError as exc:
            raise DriverError(f"container {name} could not be removed: {exc}") from exc
        anchors: dict[str, Any] = ws.meta.get("anchors") or {}
        await asyncio.to_thread(self.workspaces.remove, ws)
        evidence = await asyncio.to_thread(self._verify, name, anchors, ws)
        evidence["container_removed"] = not await self.podman.exists(name)
        evidence["checked"].insert(
            0, f"podman container exists {name}: {'no' if evidence['container_removed'] else 'YES'}"
        )
        failed = [
            k
            for k in ("container_removed", "cgroup_empty", "pid_namespace_gone", "mounts_gone", "state_dir_gone")
            if not evidence[k]
        ]
        if failed:
            raise DriverError(f"release verification failed ({', '.join(failed)}): {'; '.join(evidence['checked'])}")
        return evidence

    async def stop(self, ws: Workspace, timeout_s: float) -> None:
        # podman stop: SIGTERM (the image's StopSignal), SIGKILL after -t seconds; the release then removes it.
        seconds = max(round(timeout_s), 0)
        name = container_name(ws.allocation_id)
        await self.podman.run("stop", "-t", str(seconds), name, check=False, timeout_s=seconds + 60)

    async def write_notice(self, ws: Workspace, name: str, body: str) -> str:
        if not name.replace("_", "").isalnum():  # it goes into a path: the agent's own fixed names only
            raise DriverError("a notice name is alphanumeric")
        # As the container's root (it owns /run there); the body is an argument, never part of the script.
        script = f'mkdir -p /run/gpuaas && printf %s "$1" > /run/gpuaas/.{name} && chmod 644 /run/gpuaas/.{name}'
        script += f" && mv -f /run/gpuaas/.{name} /run/gpuaas/{name}"
        await self.podman.exec(container_name(ws.allocation_id), "/bin/sh", "-c", script, "gpuaas-notice", body)
        return f"/run/gpuaas/{name}"

    def _verify(self, name: str, anchors: dict[str, Any], ws: Workspace) -> dict[str, Any]:
        checked: list[str] = []
        # A namespace's inode number is reused soon after it dies: a process in a namespace of that number
        # is the container's only if it started before the container was removed. Processes of the namespace
        # can still be exiting right after `podman rm` returns: they are SIGKILLed and waited for (3 s).
        pidns, removed_at = anchors.get("pidns"), int(anchors.get("removed_at") or _ticks_now())
        in_ns: list[int] = []
        if pidns:
            killed: set[int] = set()
            deadline = time.monotonic() + 3
            while True:
                in_ns = [
                    int(e)
                    for e in os.listdir("/proc")
                    if e.isdigit() and _pidns(int(e)) == pidns and (_start_ticks(int(e)) or 0) <= removed_at
                ]
                if not in_ns or time.monotonic() > deadline:
                    break
                for pid in in_ns:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                time.sleep(0.05)
            checked.append(
                f"pid namespace {pidns}: {len(in_ns)} process(es) on the host started before removal"
                + (f" ({len(killed)} found draining after podman rm, SIGKILLed)" if killed else "")
            )
        else:
            checked.append("pid namespace: never recorded (the container never started)")
        cgroup_empty = True
        cgroups: list[str] = anchors.get("cgroups") or []  # recorded at start (_record_anchors)
        for cg in cgroups:
            path = Path(cg)
            try:
                left = (path / "cgroup.procs").read_text().split()
            except FileNotFoundError:
                left = []
                checked.append(f"cgroup {cg}: absent")
            else:
                checked.append(f"cgroup {cg}: {len(left)} process(es)")
            cgroup_empty = cgroup_empty and not left
        mountinfo = Path("/proc/self/mountinfo").read_text()
        watched = [m for m in (anchors.get("rootfs"), anchors.get("container_id"), str(ws.root)) if m]
        mounted = [m for m in watched if m in mountinfo]
        checked.append(f"mountinfo: {len(mounted)} of {len(watched)} watched paths still mounted")
        checked.append(f"state dir {ws.root}: {'present' if ws.root.exists() else 'absent'}")
        return {
            "driver": self.name,
            "container": name,
            "container_removed": False,
            "cgroup_empty": cgroup_empty,
            "pid_namespace_gone": not in_ns,
            "mounts_gone": not mounted,
            "state_dir_gone": not ws.root.exists(),
            "checked": checked,
        }

    async def reconcile(self) -> dict[str, Any]:
        report: dict[str, Any] = {"driver": self.name, "removed": [], "recreated": [], "failed": []}
        seen: set[str] = set()
        for c in await self.podman.containers(f"gpuaas.agent={self.agent_id}"):
            alloc = (c.get("Labels") or {}).get("gpuaas.allocation", "")
            name = (c.get("Names") or [""])[0]
            ws = self.workspaces.get(alloc) if alloc and "/" not in alloc else None
            if ws is None or not ws.root.exists() or ws.status != "active":
                reason = "unknown allocation" if ws is None or not ws.root.exists() else f"allocation {ws.status}"
                if ws is not None and ws.root.exists():
                    await self._remove(ws)
                else:
                    await self.podman.remove(name)
                report["removed"].append({"allocation_id": alloc, "container": name, "reason": reason})
                log.warning("reconcile: removed container %s (%s)", name, reason)
            else:
                seen.add(alloc)
        for ws in self.workspaces.all():
            if ws.status == "active":
                try:
                    message = await self.provision(ws)
                    if ws.allocation_id not in seen or "created" in message or "started" in message:
                        report["recreated"].append({"allocation_id": ws.allocation_id, "message": message})
                except DriverError as exc:
                    ws.write_meta(status="failed", reason=str(exc))
                    report["failed"].append({"allocation_id": ws.allocation_id, "reason": str(exc)})
                    log.error("reconcile: allocation %s could not be brought back: %s", ws.allocation_id, exc)
        try:
            report["networks_removed"] = await self.networks.prune()
        except (NetworkError, PodmanError, OSError) as exc:
            log.warning("reconcile: project networks not pruned: %s", exc)
        return report

    def session(self, ws: Workspace, command: str | None, term: str | None, mark: str = "") -> SessionCommand:
        user = ws.username
        env = {
            "HOME": f"/home/{user}",
            "USER": user,
            "LOGNAME": user,
            "LANG": "C.UTF-8",
            "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin",
            "CUDA_VISIBLE_DEVICES": ws.cuda_visible_devices(),
            "GPUAAS_ALLOCATION_ID": ws.allocation_id,  # what the process driver's sessions see too (apps key on it)
        }
        if term:
            env["TERM"] = term
        if mark:
            env[SESSION_MARK] = mark
        argv = self.podman.argv("exec", "-i", *(["-t"] if term else []), "--user", user, "--workdir", f"/home/{user}")
        for k, v in env.items():
            argv += ["--env", f"{k}={v}"]
        argv += [container_name(ws.allocation_id), "/bin/sh", "-c", PICK_SHELL, "gpuaas-shell"]
        argv += ["-c", command] if command else ["-i"]
        return SessionCommand(argv, self.podman.env, "/")

    async def end_session(self, ws: Workspace, mark: str) -> None:
        """Kill, inside the container, every process whose environment carries the session's mark (they were
        started under conmon: killing the host's `podman exec` client leaves them running)."""
        if not mark.isalnum():  # it goes into a shell script: the endpoint's hex ids only
            raise DriverError("a session mark is alphanumeric")
        script = (
            "for d in /proc/[0-9]*; do tr '\\0' '\\n' < $d/environ 2>/dev/null"
            f" | grep -qx '{SESSION_MARK}={mark}' && kill -9 ${{d#/proc/}} 2>/dev/null; done; true"
        )
        # As the allocation's user, whose processes these are: the container's root holds no CAP_KILL.
        await self.podman.exec(container_name(ws.allocation_id), "/bin/sh", "-c", script, user=ws.username)
