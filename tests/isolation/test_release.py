"""Release goes by the container, not by anything the user controls: processes started with a scrubbed
environment, a double fork or `setsid` inside the allocation do not survive release, and the release
evidence says what was checked (container removed, cgroup empty, PID namespace gone, mounts, state dir)."""

from __future__ import annotations

from typing import Any

import pytest

from .harness import Agent, Tenant, containers_of, host_pids, in_thread, marker, out

pytestmark = pytest.mark.e2e

EVIDENCE_KEYS = {"container_removed", "cgroup_empty", "pid_namespace_gone", "mounts_gone", "state_dir_gone"}


def release_evidence(alloc: dict[str, Any], timeline: list[dict[str, Any]]) -> dict[str, Any]:
    """The agent's release evidence as the platform keeps it: on the allocation, else on the release
    timeline entry (its `evidence`/`detail`)."""
    for key in ("release_evidence", "evidence"):
        if isinstance(alloc.get(key), dict):
            return alloc[key]
    for entry in timeline:
        if entry["phase"].startswith("release"):
            for key in ("evidence", "detail"):
                if isinstance(entry.get(key), dict) and "checked" in entry[key]:
                    return entry[key]
    raise AssertionError(f"no release evidence on the allocation or its timeline: {alloc}, {timeline}")


async def test_escaped_processes_do_not_survive_release(host: Agent, tenants: tuple[Tenant, Tenant]) -> None:
    owner, _ = tenants
    alloc = await owner.active(gpu_model="H100-80GB", gpu_count=1, host_class=host.host_class, name="escape")
    aid = alloc["allocation_id"]
    scrubbed, double, setsid = marker(), marker(), marker()
    # Each detaches from the SSH session (no stdio kept), as a user hiding a job from release would.
    await out(
        alloc,
        owner.key,
        f"env -i /bin/sh -c 'nohup sleep {scrubbed} >/dev/null 2>&1 </dev/null &'; "
        f"/bin/sh -c '(sleep {double} >/dev/null 2>&1 </dev/null &) &'; "
        f"setsid sleep {setsid} >/dev/null 2>&1 </dev/null & "
        "sleep 0.5; echo started",
    )
    inside = await out(alloc, owner.key, "ps -eo args")
    for m in (scrubbed, double, setsid):
        assert f"sleep {m}" in inside, inside
        assert host_pids(f"sleep {m}"), f"sleep {m} is not running on the host"
    # The user's own view of the allocation cannot mark or unmark anything release looks at.
    assert "GPUAAS_ALLOCATION_ID" not in await out(alloc, owner.key, "env -i /usr/bin/env")

    released = await owner.release(aid)
    for m in (scrubbed, double, setsid):
        assert host_pids(f"sleep {m}") == [], f"sleep {m} survived the release"
    assert await in_thread(containers_of, aid) == []
    evidence = release_evidence(released, await owner.timeline(aid))
    assert set(evidence) >= EVIDENCE_KEYS, evidence
    assert all(evidence[k] is True for k in EVIDENCE_KEYS), evidence
    assert evidence["checked"], evidence
    timeline = await owner.timeline(aid)
    assert [e for e in timeline if e["phase"] == "release.verify" and e["status"] == "succeeded"], timeline
