"""`python -m gpuaas.devstack run | stop | status | migrate` (what `make run` / `make migrate` call).

- run: start the whole stack (default ports: gateway 8000, services 8001-8006, Postgres 5433,
  Tansu 9092), print the URLs and logins, supervise until Ctrl-C / SIGTERM, then stop everything.
- stop: stop the stack recorded in <root>/stack.json (its runner, then any process it left).
- status: what stack.json records, and whether each process is alive and ready.
- migrate: provision the database, roles and schemas and run every service's migrations.

`GPUAAS_DATABASE_URL` (a superuser URL) and `GPUAAS_KAFKA_BOOTSTRAP` point the stack at existing
servers instead of the embedded ones.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from gpuaas.devstack.config import GATEWAY, StackError, StackInterrupted
from gpuaas.devstack.stack import Stack
from gpuaas.devstack.state import proc_matches, read_json, stop_recorded, wait_gone, write_private

log = logging.getLogger("gpuaas.devstack")


def workspace_root(start: Path | None = None) -> Path:
    """The uv workspace root (the directory whose pyproject.toml declares the workspace), else cwd."""
    here = (start or Path.cwd()).absolute()
    for d in (here, *here.parents):
        pp = d / "pyproject.toml"
        try:
            if pp.is_file() and "[tool.uv.workspace]" in pp.read_text():
                return d
        except OSError:
            continue
    return here


def _setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s devstack %(levelname)-7s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    for noisy in ("httpx", "httpcore", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _rel(path: str | Path) -> str:
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def banner(stack: Stack, elapsed_s: float | None = None) -> str:
    st = stack.state()
    db, broker = st["database"], st["broker"]
    email, password = stack.admin_login
    width = max(len(n) for n in st["services"]) + 2
    lines = [
        "",
        f"GPUaaS local stack is up{f' ({elapsed_s:.0f}s)' if elapsed_s else ''}",
        "",
        f"  Gateway    {st['gateway']['url']}" + ("" if GATEWAY in stack.names else "   (not running: skipped)"),
        f"  API docs   {st['docs']}",
        "  Services   "
        + "\n             ".join(f"{n:<{width}}{s['url']}   docs {s['url']}/docs" for n, s in st["services"].items()),
        f"  Postgres   {db['host']}:{db['port']}/{db['name']}  "
        + (
            f"(embedded, data {_rel(db['data_dir'])}; superuser '{db['superuser']}', password in {_rel(st['secrets'])})"
            if db["embedded"]
            else f"(external {db['url']})"
        ),
        f"  Kafka      {broker['bootstrap']}  "
        + ("(embedded Tansu, in memory; the runner restarts and replays)" if broker["embedded"] else "(external)"),
        f"  Login      {email} / {password}   (platform operator)",
        f"  Logs       {_rel(st['logs'])}/<name>.log",
        f"  State      {_rel(stack.state_path)}   (URLs, pids, logins for scripts and tests)",
    ]
    registry = st.get("registry")
    if registry:
        images = ", ".join(f"{slug} {i['version']}" for slug, i in registry["images"].items())
        lines.append(
            f"  Registry   {registry['address']}  (OCI, plain HTTP; runtime images {images or 'missing: see the log'};"
            f" agents use the {registry['agent_driver']} driver)"
        )
    gpus = dict(stack.config.agents)
    if st.get("agents"):
        lines.append(
            "  GPU hosts  "
            + ", ".join(f"{n} ({gpus.get(n, '?')}, agent pid {a['pid']})" for n, a in st["agents"].items())
            + "   (node-agents with declared GPUs; create an allocation at once)"
        )
    lines += ["", "Ctrl-C stops everything.", ""]
    return "\n".join(lines)


def cmd_run(args: argparse.Namespace) -> int:
    stack = Stack(root=args.root, free_ports=args.free_ports)

    def on_signal(signum: int, _frame: Any) -> None:
        if not stack.cancel.is_set():
            log.info("%s: stopping the stack", signal.Signals(signum).name)
        stack.cancel.set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    rc = 0
    t0 = time.monotonic()
    try:
        stack.start()
        print(banner(stack, time.monotonic() - t0), flush=True)
        stack.supervise()
    except StackInterrupted:
        pass
    except StackError as exc:
        log.error("%s", exc)
        rc = 1
    finally:
        stack.stop()
    return rc


def cmd_migrate(args: argparse.Namespace) -> int:
    stack = Stack(root=args.root)
    try:
        stack.migrate()
    except StackError as exc:
        log.error("%s", exc)
        return 1
    print(f"migrated: {', '.join(stack.services)} (database {stack.config.database})")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    path = Path(args.root) / "stack.json"
    state = read_json(path)
    if not state:
        print(f"no stack recorded in {path}")
        return 0
    runner = state.get("runner") or {}
    proc = proc_matches(runner.get("pid"), runner.get("create_time"))
    if proc is not None and proc.pid != os.getpid():
        print(f"stopping the runner (pid {proc.pid})…", flush=True)
        proc.send_signal(signal.SIGTERM)
        if wait_gone([proc], 90):
            print("the runner did not stop in 90s; stopping its processes directly")
    leftovers = stop_recorded(state)
    if leftovers:
        print(f"stopped: {', '.join(leftovers)}")
    latest = read_json(path) or state
    latest["running"] = False
    write_private(path, latest)
    print("stack stopped")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    path = Path(args.root) / "stack.json"
    state = read_json(path)
    if not state:
        print(f"no stack recorded in {path}")
        return 1
    rows: dict[str, dict[str, Any]] = {}
    urls = {n: s["url"] for n, s in state.get("services", {}).items()}
    urls[GATEWAY] = state["gateway"]["url"]
    with httpx.Client(timeout=2.0) as client:
        for name, info in (state.get("processes") or {}).items():
            alive = proc_matches(info.get("pid"), info.get("create_time")) is not None
            ready: str = "-"
            if name in urls and alive:
                try:
                    ready = str(client.get(f"{urls[name]}/readyz").status_code)
                except httpx.HTTPError as exc:
                    ready = type(exc).__name__
            rows[name] = {"pid": info.get("pid"), "alive": alive, "readyz": ready, "url": urls.get(name, "")}
    runner = state.get("runner") or {}
    runner_alive = proc_matches(runner.get("pid"), runner.get("create_time")) is not None
    if args.json:
        print(json.dumps({"running": state.get("running"), "runner_alive": runner_alive, "processes": rows}, indent=2))
    else:
        print(
            f"stack in {state.get('root')}: {'running' if state.get('running') else 'stopped'}"
            f" (runner pid {runner.get('pid')}, {'alive' if runner_alive else 'gone'})"
        )
        for name, r in rows.items():
            up = "up  " if r["alive"] else "down"
            print(f"  {name:<12} pid {r['pid']!s:<8} {up}  readyz {r['readyz']:<4} {r['url']}")
    ok = all(r["alive"] and r["readyz"] in ("200", "-") for r in rows.values())
    return 0 if state.get("running") and ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuaas.devstack", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--root", type=Path, default=None, help="state directory (default: <workspace>/.local)")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="start everything, supervise until Ctrl-C, stop everything")
    run.add_argument("--free-ports", action="store_true", help="pick free ports instead of the defaults")
    sub.add_parser("migrate", help="provision the database and run every service's migrations")
    sub.add_parser("stop", help="stop the stack recorded in stack.json")
    status = sub.add_parser("status", help="show the recorded stack and whether each process is ready")
    status.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.root is None:
        args.root = workspace_root() / ".local"
    _setup_logging(args.verbose)
    handlers = {"run": cmd_run, "migrate": cmd_migrate, "stop": cmd_stop, "status": cmd_status}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
