"""Limits per allocation from the host class (a share per GPU, a pids limit): a memory hog and a fork bomb
in tenant A's allocation are held by A's limits while tenant B's SSH session on the same host keeps
answering. The limits are read from inside A's cgroup before anything heavy runs, so a host that does not
enforce them fails the test instead of being brought down by it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from .harness import Agent, Tenant, connect, limits_class, out, sh

pytestmark = pytest.mark.e2e

CPUS_PER_GPU = 0.5
MEMORY_MB_PER_GPU = 256
PIDS = 128

# cgroup v1 (this machine kind) or v2, read from inside the container.
READ_LIMITS = r"""
for f in /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/memory.max; do
  [ -r $f ] && echo memory=$(cat $f) && break; done
for f in /sys/fs/cgroup/pids/pids.max /sys/fs/cgroup/pids.max; do [ -r $f ] && echo pids=$(cat $f) && break; done
if [ -r /sys/fs/cgroup/cpu/cpu.cfs_quota_us ]; then
  echo cpu=$(cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us)/$(cat /sys/fs/cgroup/cpu/cpu.cfs_period_us)
elif [ -r /sys/fs/cgroup/cpu.max ]; then set -- $(cat /sys/fs/cgroup/cpu.max); echo cpu=$1/$2; fi
"""

# Allocates 64 MiB at a time (touched) up to 4x the limit; the kernel must stop it first.
HOG = "python3 -c 'b=[]\nfor i in range({n}): b.append(bytearray(64<<20)); print(i, flush=True)'"

# Forks sleeping children until fork fails; prints how many it got and the errno, then kills them.
FORKS = """python3 - <<'EOF'
import errno, os, time
kids, err = [], None
for _ in range(5000):
    try:
        pid = os.fork()
    except OSError as e:
        err = errno.errorcode.get(e.errno, e.errno); break
    if pid == 0:
        time.sleep(60); os._exit(0)
    kids.append(pid)
print(len(kids), err, flush=True)
for k in kids: os.kill(k, 9)
EOF"""


def parse_limits(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.split() if "=" in line)


class Heartbeat:
    """B's SSH session answering `echo` every 0.25 s; the slowest answer and any failure are kept."""

    def __init__(self, alloc: dict[str, Any], tenant: Tenant) -> None:
        self.alloc, self.tenant = alloc, tenant
        self.slowest, self.answers, self.errors = 0.0, 0, []
        self._stop = asyncio.Event()

    async def run(self) -> None:
        async with connect(self.alloc, self.tenant.key) as conn:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    r = await conn.run("echo pong", check=False, timeout=15)
                    if r.stdout.strip() == "pong":
                        self.answers += 1
                    else:
                        self.errors.append(r.stderr)
                except Exception as exc:  # recorded, asserted on below
                    self.errors.append(repr(exc))
                self.slowest = max(self.slowest, time.monotonic() - t0)
                await asyncio.sleep(0.25)

    def stop(self) -> None:
        self._stop.set()


async def test_memory_hog_and_fork_bomb_stay_in_their_allocation(
    host: Agent, tenants: tuple[Tenant, Tenant], gw: httpx.AsyncClient
) -> None:
    await limits_class(
        gw, host.host_class, cpus_per_gpu=CPUS_PER_GPU, memory_mb_per_gpu=MEMORY_MB_PER_GPU, pids_limit=PIDS
    )
    ta, tb = tenants
    a = await ta.active(gpu_model="H100-80GB", gpu_count=1, host_class=host.host_class, name="hog")
    b = await tb.active(gpu_model="H100-80GB", gpu_count=1, host_class=host.host_class, name="neighbour")
    assert a["host_id"] == b["host_id"]
    assert a["limits"] == {"cpus": CPUS_PER_GPU, "memory_mb": MEMORY_MB_PER_GPU, "pids": PIDS}, a["limits"]

    limits = parse_limits(await out(a, ta.key, READ_LIMITS))
    assert int(limits["memory"]) <= MEMORY_MB_PER_GPU << 20, limits
    assert int(limits["pids"]) <= PIDS, limits
    quota, period = (int(x) for x in limits["cpu"].split("/"))
    assert 0 < quota / period <= CPUS_PER_GPU + 0.01, limits

    beat = Heartbeat(b, tb)
    beating = asyncio.create_task(beat.run())
    try:
        await asyncio.sleep(1)
        # Memory: the hog is stopped (OOM kill or MemoryError) long before 4x the limit.
        n = 4 * MEMORY_MB_PER_GPU // 64
        hog = await sh(a, ta.key, HOG.format(n=n), 120)
        assert hog.exit_status != 0, "the memory hog got 4x its allocation's memory limit"
        reached = [int(x) for x in hog.stdout.split()]
        assert max(reached, default=0) < n - 1, hog.stdout

        # Processes: forking stops at the pids limit with EAGAIN...
        forks = await sh(a, ta.key, FORKS, 120)
        got, err = forks.stdout.split()
        assert int(got) < PIDS and err == "EAGAIN", forks.stdout + forks.stderr
        # ... and a real fork bomb, left running, is held there too (and burns only A's CPU share).
        bomb = "(setsid bash -c ':(){ :|:& };:' >/dev/null 2>&1 </dev/null &); echo lit"
        assert "lit" in (await sh(a, ta.key, bomb, 60)).stdout
        await asyncio.sleep(10)
        r = await sh(b, tb.key, "echo still-here", 30)
        assert r.stdout.strip() == "still-here"
    finally:
        beat.stop()
        await asyncio.wait_for(beating, 60)
    assert beat.errors == [] and beat.answers >= 10, (beat.errors, beat.answers)
    assert beat.slowest < 5.0, f"B's session took {beat.slowest:.1f}s to answer while A misbehaved"

    # Releasing A ends the bomb (the container goes); B is untouched.
    await ta.release(a["allocation_id"])
    assert (await out(b, tb.key, "echo after")).strip() == "after"
    await tb.release(b["allocation_id"])
