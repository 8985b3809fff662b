#!/usr/bin/python3
"""`sudo` for containers that run with no-new-privileges (runs inside the container, on its own python3).

no-new-privileges stops every setuid binary, the image's /usr/bin/sudo included. The allocation's user
keeps sudo through a broker instead: PID 1 of the container (root of the container's user namespace, the
one process started before any session) serves a unix socket; this same file, bind-mounted read-only as
/usr/local/bin/sudo (first on the sessions' PATH), is the client. The broker runs a command only for a
peer whose uid (SO_PEERCRED, set by the kernel) is the allocation's user or root: the same grant the image's
sudoers file gives (`<user> ALL=(ALL:ALL) NOPASSWD: ALL`). The client's stdin/stdout/stderr are passed to
the command (SCM_RIGHTS), signals are relayed, the exit status comes back; as with sudo, a command outlives
a client that goes away (daemons started with sudo stay). The command runs in a session of its own without a
controlling terminal (its stdin may still be the session's terminal).

    sudo --gpuaas-serve UID [-- COMMAND...]   PID 1: serve; run COMMAND as a child (a workload) and exit
                                              with it, or idle until SIGTERM (as `gpuaas-init --idle`)
    sudo [-n] [-E] [-H] [-i|-s] [-u USER] [--] [VAR=value...] COMMAND...
"""

from __future__ import annotations

import array
import json
import os
import pwd
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from types import TracebackType
from typing import TypedDict, cast

SOCKET = "/run/gpuaas-sudo/sock"
SECURE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TRACKED: set[int] = set()  # pids of the commands being served (their threads wait for them)
SPAWNING = threading.Lock()  # held from fork to TRACKED.add: the reaper never takes a command's exit status
KEEP_ENV = ("TERM", "LANG", "LC_ALL", "COLORTERM", "DISPLAY", "CUDA_VISIBLE_DEVICES", "GPUAAS_ALLOCATION_ID")


class Options(TypedDict):
    """The client's sudo options and command."""

    user: str  # a name, or #uid
    keep_env: bool
    login: bool
    shell: bool
    env: dict[str, str]  # VAR=value words before the command
    argv: list[str]


class Request(Options):
    """What the client sends the broker (JSON, before the passed file descriptors)."""

    cwd: str
    client_env: dict[str, str]


def _fail(message: str, code: int = 1) -> int:
    sys.stderr.write(f"sudo: {message}\n")
    return code


# ------------------------------------------------------------------------------------------ client


def parse(argv: list[str]) -> Options | str:
    """sudo's common options; anything else is refused with a message (never silently dropped)."""
    req: Options = {"user": "root", "keep_env": False, "login": False, "shell": False, "env": {}, "argv": []}
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        opt = argv[i]
        if opt == "--":
            i += 1
            break
        if opt in ("-u", "--user") and i + 1 < len(argv):
            req["user"] = argv[i + 1]
            i += 2
            continue
        if opt.startswith("-u") and len(opt) > 2:
            req["user"] = opt[2:]
        elif opt in ("-E", "--preserve-env"):
            req["keep_env"] = True
        elif opt in ("-i", "--login"):
            req["login"] = True
        elif opt in ("-s", "--shell"):
            req["shell"] = True
        elif opt in ("-n", "--non-interactive", "-H", "--set-home", "-S", "--stdin", "-k", "--reset-timestamp"):
            pass  # no password is ever asked; HOME is always the target's
        elif opt in ("-v", "--validate"):
            return "validate"
        else:
            return f"option {opt} is not supported here"
        i += 1
    rest = argv[i:]
    while rest and "=" in rest[0] and not rest[0].startswith("="):
        k, v = rest.pop(0).split("=", 1)
        req["env"][k] = v
    if not rest and not (req["login"] or req["shell"]):
        return "usage: sudo [-n] [-E] [-i|-s] [-u user] [--] [VAR=value...] command"
    req["argv"] = rest
    return req


def client(argv: list[str]) -> int:
    options = parse(argv)
    if options == "validate":
        return 0
    if isinstance(options, str):
        return _fail(options)
    keep = options["keep_env"]
    req: Request = {
        **options,
        "cwd": os.getcwd(),
        "client_env": dict(os.environ) if keep else {k: os.environ[k] for k in KEEP_ENV if k in os.environ},
    }
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(SOCKET)
    except OSError as exc:
        return _fail(f"the container's sudo service does not answer ({exc})")
    payload = json.dumps(req).encode()
    fds = array.array("i", [0, 1, 2])
    sock.sendmsg([struct.pack("!I", len(payload)) + payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])

    def forward(signum: int, _frame: object) -> None:
        sock.sendall(b"S" + bytes([signum]))

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # `nohup sudo ...` keeps its command through a hangup
            signal.signal(sig, forward)
    reply = b""
    while len(reply) < 5:
        chunk = sock.recv(5 - len(reply))
        if not chunk:
            return _fail("the sudo service closed the connection")
        reply += chunk
    if reply[:1] == b"E":
        size = struct.unpack("!I", reply[1:5])[0]
        return _fail(sock.recv(size).decode(errors="replace"))
    return struct.unpack("!i", reply[1:5])[0]


# ------------------------------------------------------------------------------------------ server


def _strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(x, str) for x in cast("list[object]", value))


def _string_map(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in cast("dict[object, object]", value).items()
    )


def _checked(raw: object) -> Request:
    """The client's JSON, field by field (it comes from a process of the allocation, never trusted)."""
    if not isinstance(raw, dict):
        raise ValueError("malformed sudo request")
    req = cast("dict[str, object]", raw)
    if not (
        all(isinstance(req.get(k), str) for k in ("user", "cwd"))
        and all(isinstance(req.get(k), bool) for k in ("keep_env", "login", "shell"))
        and _strings(req.get("argv"))
        and _string_map(req.get("env"))
        and _string_map(req.get("client_env"))
    ):
        raise ValueError("malformed sudo request")
    return cast("Request", req)


def _recv_request(conn: socket.socket) -> tuple[Request, list[int]]:
    fds = array.array("i")
    msg, ancdata, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    size = struct.unpack("!I", msg[:4])[0]
    body = msg[4:]
    while len(body) < size:
        more = conn.recv(size - len(body))
        if not more:
            break
        body += more
    return _checked(json.loads(body)), list(fds)


def _serve_one(conn: socket.socket, allowed: set[int]) -> None:
    fds: list[int] = []
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _, uid, _ = struct.unpack("3i", creds)
        req, fds = _recv_request(conn)
        if uid not in allowed:
            raise PermissionError(f"uid {uid} may not use sudo in this container")
        if len(fds) != 3:
            raise ValueError("the client did not pass its stdin/stdout/stderr")
        target = (
            pwd.getpwnam(req["user"]) if not str(req["user"]).startswith("#") else pwd.getpwuid(int(req["user"][1:]))
        )
        argv = list(req["argv"])
        if req["login"] or req["shell"]:
            shell = target.pw_shell or "/bin/sh"
            argv = [shell, *(["-l"] if req["login"] else []), *(["-c", " ".join(argv)] if argv else [])]
        env = {**req["client_env"], **req["env"]}
        env.update(HOME=target.pw_dir, USER=target.pw_name, LOGNAME=target.pw_name, SHELL=target.pw_shell)
        env.setdefault("PATH", SECURE_PATH)
        if not req["keep_env"]:
            env["PATH"] = SECURE_PATH
        env.update(SUDO_UID=str(uid), SUDO_COMMAND=" ".join(argv)[:4096])
        cwd = target.pw_dir if req["login"] else req.get("cwd") or "/"
        if not os.path.isdir(cwd):
            cwd = "/"
        with SPAWNING:
            proc = subprocess.Popen(  # the command is the user's: running it is the point
                argv,
                stdin=fds[0],
                stdout=fds[1],
                stderr=fds[2],
                cwd=cwd,
                env=env,
                user=target.pw_uid,
                group=target.pw_gid,
                extra_groups=os.getgrouplist(target.pw_name, target.pw_gid),
                start_new_session=True,
            )
            TRACKED.add(proc.pid)
    except Exception as exc:  # every failure goes back to the client as its message
        text = str(exc).encode()
        conn.sendall(b"E" + struct.pack("!I", len(text)) + text)
        conn.close()
        for fd in fds:
            os.close(fd)
        return
    for fd in fds:
        os.close(fd)
    done = threading.Event()

    def watch() -> None:  # signals the client relays
        while not done.is_set():
            try:
                ready, _, _ = select.select([conn], [], [], 0.5)
                data = conn.recv(2) if ready else None
            except (OSError, ValueError):  # closed by the serving thread: the command is done
                return
            if data is None:
                continue
            if not data:  # the client is gone: as with sudo, the command runs on
                return
            if data[:1] == b"S" and len(data) == 2:
                with _suppress():
                    os.killpg(proc.pid, data[1])

    threading.Thread(target=watch, daemon=True).start()
    code = proc.wait()
    TRACKED.discard(proc.pid)
    done.set()
    status = 128 - code if code < 0 else code
    with _suppress():
        conn.sendall(b"X" + struct.pack("!i", status))
    conn.close()


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> bool:
        return kind is not None and issubclass(kind, OSError)


def serve(argv: list[str]) -> int:
    """PID 1: reap orphans, serve sudo, run the workload (if any) and stop with it or with SIGTERM."""
    allowed = {0, int(argv[0])}
    command = argv[2:] if len(argv) > 1 and argv[1] == "--" else []
    os.makedirs(os.path.dirname(SOCKET), mode=0o755, exist_ok=True)
    if os.path.exists(SOCKET):
        os.unlink(SOCKET)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(SOCKET)
    os.chmod(SOCKET, 0o666)  # who may use it is decided by the peer's uid, per connection
    server.listen(64)
    child = subprocess.Popen(command) if command else None  # the container's own command
    stopping = threading.Event()

    def stop(signum: int, _frame: object) -> None:
        stopping.set()
        if child is not None:
            with _suppress():
                child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    server.settimeout(0.5)
    while not stopping.is_set():
        try:
            conn, _ = server.accept()
        except TimeoutError:
            conn = None
        except InterruptedError:
            continue
        if conn is not None:
            conn.settimeout(None)
            threading.Thread(target=_serve_one, args=(conn, allowed), daemon=True).start()
        if child is not None and child.poll() is not None:
            return child.returncode if child.returncode >= 0 else 128 - child.returncode
        _reap(TRACKED | ({child.pid} if child is not None else set()))
    if child is not None:
        try:
            return child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
    return 0


def _reap(tracked: set[int]) -> None:
    """As PID 1, collect orphans re-parented to us; never a command a connection thread waits for (its
    Popen would lose the exit status)."""
    me = str(os.getpid())
    with SPAWNING:
        _reap_locked(me, tracked | TRACKED)


def _reap_locked(me: str, tracked: set[int]) -> None:
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in tracked:
            with _suppress():
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] == "Z" and fields[1] == me:
                    os.waitpid(int(entry), os.WNOHANG)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--gpuaas-serve":
        return serve(sys.argv[2:])
    return client(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
