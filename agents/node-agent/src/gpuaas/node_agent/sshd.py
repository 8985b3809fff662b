"""The SSH endpoint the agent serves for its allocations (asyncssh; works unprivileged).

The user name is the allocation's account. Public keys are checked against the allocation's
`authorized_keys`, read at every login (a revoked grant is refused at once), plus the platform CA
(`cert-authority`) whose short-lived certificates the browser terminal uses. The endpoint remembers which
key each connection signed in with and which processes each session started: when a key sync removes a
key (`end_removed_keys`), that key's connections are closed and their sessions' processes killed (every
process of the session, job-control groups included; one that called setsid itself is left to release).
What a session runs is the runtime driver's: `podman exec -i [-t] --user <username> ... <container> sh`
(container driver) or a shell in the workspace joined to the allocation's cgroup (process driver); with a pty when
asked (pty.openpty + TIOCSWINSZ + a new session + TIOCSCTTY; podman exec -t attaches to it).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import pty
import secrets
import signal
import struct
import subprocess
import termios
from collections.abc import Callable
from pathlib import Path

import asyncssh

from gpuaas.node_agent.drivers import Driver, SessionCommand
from gpuaas.node_agent.workspace import Workspaces

# The server runs with encoding=None: a session's streams carry bytes.
SessionProcess = asyncssh.SSHServerProcess[bytes]
Connection = asyncssh.SSHServerConnection


def key_blobs(lines: str) -> set[bytes]:
    """The public key blobs of an authorized_keys text (lines that do not parse are skipped)."""
    blobs: set[bytes] = set()
    for line in lines.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            blobs.add(asyncssh.import_public_key(line).public_data)
        except (asyncssh.KeyImportError, ValueError):
            continue
    return blobs


def _session_members(leader: int) -> list[int]:
    """Every process whose session id is `leader` (a session's shell, its jobs and their children)."""
    members = [leader]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == leader:
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp session ...
        if len(fields) > 3 and fields[3] == str(leader):
            members.append(int(entry.name))
    return members


def kill_session(leader: int) -> None:
    for pid in _session_members(leader):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _join_cgroup(procs: Path | None) -> None:
    """In the child before exec: move into the allocation's cgroup ("0" is the writing process)."""
    if procs is not None:
        fd = os.open(procs, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)


class Endpoint:
    def __init__(
        self, workspaces: Workspaces, driver: Driver, host_key_path: Path, ca_key: Callable[[], str | None]
    ) -> None:
        self.workspaces = workspaces
        self.driver = driver
        self.host_key_path = host_key_path
        self.ca_key = ca_key
        self.connections: dict[str, set[Connection]] = {}
        # The public key blob each connection signed in with (none: a terminal's short-lived certificate).
        self.connection_keys: dict[Connection, bytes] = {}
        # Each connection's sessions: their mark (Driver.session) and the host process that leads each.
        self.session_pids: dict[Connection, dict[str, int]] = {}
        # Each account's open sessions (their channels), for a message to all of them (a preemption notice).
        self.open_sessions: dict[str, set[SessionProcess]] = {}
        self.server: asyncssh.SSHAcceptor | None = None

    def _host_key(self) -> asyncssh.SSHKey:
        if not self.host_key_path.exists():
            # asyncssh leaves the algorithm's **kwargs untyped; the call passes none and returns an SSHKey.
            key = asyncssh.generate_private_key("ssh-ed25519")  # pyright: ignore[reportUnknownMemberType]
            self.host_key_path.write_bytes(key.export_private_key())
            os.chmod(self.host_key_path, 0o600)
        return asyncssh.read_private_key(str(self.host_key_path))

    @property
    def host_public_key(self) -> str:
        """The endpoint's host key as an OpenSSH public key line (what a client's known_hosts pins)."""
        return self._host_key().export_public_key().decode().strip()

    async def start(self, host: str, port: int) -> int:
        endpoint = self

        class Server(asyncssh.SSHServer):
            def connection_made(self, conn: Connection) -> None:
                self.conn = conn
                self.username: str | None = None
                self.key: bytes | None = None

            def connection_lost(self, exc: Exception | None) -> None:
                if self.username:
                    endpoint.connections.get(self.username, set()).discard(self.conn)
                endpoint.connection_keys.pop(self.conn, None)
                endpoint.session_pids.pop(self.conn, None)

            def begin_auth(self, username: str) -> bool:
                # Only the CA goes to asyncssh's own check (terminal certificates); plain keys come to
                # validate_public_key, so the endpoint knows which key a connection used.
                ws = endpoint.workspaces.by_username(username)
                ca = endpoint.ca_key()
                lines = f"cert-authority {ca}\n" if ws is not None and ws.active and ca else ""
                self.conn.set_authorized_keys(asyncssh.import_authorized_keys(lines))
                return True

            def public_key_auth_supported(self) -> bool:
                return True

            def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
                ws = endpoint.workspaces.by_username(username)
                if ws is None or not ws.active or key.public_data not in key_blobs(ws.authorized_keys()):
                    return False
                self.key = key.public_data
                return True

            def password_auth_supported(self) -> bool:
                return False

            def auth_completed(self) -> None:
                username: str = self.conn.get_extra_info("username")  # set once authentication is complete
                self.username = username
                endpoint.connections.setdefault(username, set()).add(self.conn)
                if self.key is not None:
                    endpoint.connection_keys[self.conn] = self.key

        self.server = await asyncssh.create_server(
            Server,
            host,
            port,
            server_host_keys=[self._host_key()],
            process_factory=self._session,
            encoding=None,
            sftp_factory=False,
            allow_scp=False,
            keepalive_interval=30,
        )
        return self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    def disconnect(self, username: str) -> int:
        """Interrupt every SSH session of an account (restart, release, revocation)."""
        conns = list(self.connections.pop(username, set()))
        for c in conns:
            c.close()
        return len(conns)

    async def end_removed_keys(self, username: str, authorized_keys: str) -> int:
        """Close the connections of `username` whose key is no longer in `authorized_keys` and kill what
        their sessions started (on the host, then through the driver inside the allocation); the number of
        connections closed. A terminal's certificate connection is not a key's: the platform closes it with
        the terminal's token."""
        allowed = key_blobs(authorized_keys)
        ws = self.workspaces.by_username(username)
        closed = 0
        for conn in list(self.connections.get(username, set())):
            key = self.connection_keys.get(conn)
            if key is None or key in allowed:
                continue
            sessions = self.session_pids.pop(conn, {})
            conn.close()
            self.connections.get(username, set()).discard(conn)
            for leader in sessions.values():
                kill_session(leader)
            if ws is not None:
                for mark in sessions:
                    await self.driver.end_session(ws, mark)
            closed += 1
        return closed

    def tell(self, username: str, message: str) -> int:
        """Write `message` to every open session of an account, like wall(1) to its terminals (stdout with a
        pty, stderr without: a command's output stays clean); the number of sessions told."""
        told = 0
        for process in list(self.open_sessions.get(username, set())):
            if process.get_terminal_type() is not None:
                stream, text = process.stdout, "\r\n" + message.replace("\n", "\r\n") + "\r\n"
            else:
                stream, text = process.stderr, f"\n{message}\n"
            with contextlib.suppress(Exception):  # a channel closing meanwhile
                stream.write(text.encode())
                told += 1
        return told

    def _track(self, process: SessionProcess, mark: str, pid: int) -> Callable[[], None]:
        conn: Connection = process.get_extra_info("connection")
        self.session_pids.setdefault(conn, {})[mark] = pid

        def untrack() -> None:
            self.session_pids.get(conn, {}).pop(mark, None)

        return untrack

    async def _session(self, process: SessionProcess) -> None:
        username: str = process.get_extra_info("username")
        ws = self.workspaces.by_username(username)
        if ws is None or not ws.active:
            process.stderr.write(b"this allocation is not active\n")
            process.exit(1)
            return
        sessions = self.open_sessions.setdefault(username, set())
        sessions.add(process)
        try:
            term = process.get_terminal_type()
            mark = secrets.token_hex(8)
            cmd = self.driver.session(ws, process.command, term, mark)
            rc = await (self._run_pty(process, cmd, mark) if term else self._run_pipes(process, cmd, mark))
        except Exception as exc:  # report to the client rather than dropping the channel
            process.stderr.write(f"session failed: {exc}\n".encode())
            rc = 255
        finally:
            sessions.discard(process)
        with contextlib.suppress(Exception):
            process.exit(rc)

    async def _run_pipes(self, process: SessionProcess, cmd: SessionCommand, mark: str) -> int:
        proc = await asyncio.create_subprocess_exec(
            *cmd.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cmd.cwd,
            env=cmd.env,
            start_new_session=True,
            preexec_fn=lambda: _join_cgroup(cmd.cgroup_procs),
        )
        untrack = self._track(process, mark, proc.pid)

        async def copy(reader: asyncio.StreamReader, writer: asyncssh.SSHWriter[bytes]) -> None:
            while data := await reader.read(65536):
                writer.write(data)

        async def feed() -> None:
            assert proc.stdin is not None
            try:
                while True:
                    data = await process.stdin.read(65536)
                    if not data:
                        break
                    proc.stdin.write(data)
                    await proc.stdin.drain()
            except (
                asyncssh.BreakReceived,
                asyncssh.SignalReceived,
                asyncssh.TerminalSizeChanged,
                ConnectionError,
                BrokenPipeError,
            ):
                pass
            with contextlib.suppress(Exception):
                proc.stdin.close()

        feeder = asyncio.create_task(feed())
        assert proc.stdout is not None and proc.stderr is not None
        await asyncio.gather(copy(proc.stdout, process.stdout), copy(proc.stderr, process.stderr))
        rc = await proc.wait()
        untrack()
        feeder.cancel()
        return rc if rc >= 0 else 128 - rc

    async def _run_pty(self, process: SessionProcess, cmd: SessionCommand, mark: str) -> int:
        master, slave = pty.openpty()
        cols, rows = process.get_terminal_size()[:2]
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows or 24, cols or 80, 0, 0))

        def controlling_tty() -> None:
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
            _join_cgroup(cmd.cgroup_procs)

        proc = subprocess.Popen(  # noqa: ASYNC220 - a pty child needs preexec_fn (TIOCSCTTY)
            cmd.argv,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            cwd=cmd.cwd,
            env=cmd.env,
            start_new_session=True,
            preexec_fn=controlling_tty,
            close_fds=True,
        )
        os.close(slave)
        untrack = self._track(process, mark, proc.pid)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[bytes] = asyncio.Queue()

        def readable() -> None:
            try:
                data = os.read(master, 65536)
            except OSError:
                data = b""
            if not data:
                loop.remove_reader(master)
            queue.put_nowait(data)

        loop.add_reader(master, readable)

        async def out() -> None:
            while data := await queue.get():
                process.stdout.write(data)

        async def feed() -> None:
            while True:
                try:
                    data = await process.stdin.read(65536)
                except asyncssh.TerminalSizeChanged as change:
                    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", change.height, change.width, 0, 0))
                    continue
                except (asyncssh.BreakReceived, asyncssh.SignalReceived):
                    continue
                except (ConnectionError, OSError):
                    break
                if not data:
                    break
                with contextlib.suppress(OSError):
                    os.write(master, data)
            # The channel closed (the client left, or the platform closed a revoked terminal): hang up the
            # session like sshd does. Otherwise the shell lives on and proc.wait holds a worker thread for
            # good; a few such sessions exhaust the default executor and every later login hangs.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGHUP)

        out_task = asyncio.create_task(out())
        feeder = asyncio.create_task(feed())
        rc = await asyncio.to_thread(proc.wait)
        untrack()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(out_task, 0.5)
        for t in (out_task, feeder):
            t.cancel()
        loop.remove_reader(master)
        os.close(master)
        return rc if rc >= 0 else 128 - rc
