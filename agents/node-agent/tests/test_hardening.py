"""The node token file's checks and file operations that never follow a link out of the allocation."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
from agent_harness import Host, agent_settings, write_token

from gpuaas.node_agent import safefs
from gpuaas.node_agent.settings import AgentSettings, TokenFileUnsafe, read_node_token


def test_token_file_must_be_private(tmp_path: Path) -> None:
    token = write_token(tmp_path / "token")
    assert read_node_token(AgentSettings(node_token_file=token)) == "node-token-for-tests"
    for mode in (0o640, 0o604, 0o660):
        os.chmod(token, mode)
        with pytest.raises(TokenFileUnsafe, match="must be 0600"):
            read_node_token(AgentSettings(node_token_file=token))
    os.chmod(token, 0o600)
    link = tmp_path / "link"
    link.symlink_to(token)
    with pytest.raises(OSError):  # O_NOFOLLOW: a link could be swapped to another file
        read_node_token(AgentSettings(node_token_file=link))
    os.chown(token, 12345, 12345)
    with pytest.raises(TokenFileUnsafe, match="owned by uid 12345"):
        read_node_token(AgentSettings(node_token_file=token))


def test_agent_keeps_token_out_of_its_environment(tmp_path: Path) -> None:
    settings = agent_settings(tmp_path / "agent", "process")
    assert settings.node_token.get_secret_value() == ""
    assert read_node_token(settings) == "node-token-for-tests"


def test_safe_writes_do_not_follow_links(tmp_path: Path) -> None:
    base = tmp_path / "home"
    base.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim"
    victim.write_text("untouched")
    (base / ".gpuaas").symlink_to(victim)
    safefs.write_file(base, ".gpuaas", b"marker")  # replaces the link, never writes through it
    assert victim.read_text() == "untouched" and (base / ".gpuaas").read_text() == "marker"

    (base / "volumes").symlink_to(outside, target_is_directory=True)
    with pytest.raises(safefs.UnsafePath):
        safefs.make_link(base, "volumes/v1", tmp_path / "data")
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]
    with pytest.raises(safefs.UnsafePath):
        safefs.write_file(base, "volumes/x", b"x")
    with pytest.raises(safefs.UnsafePath):
        safefs.open_dir(base, "../outside")

    (base / "dir").mkdir()
    (base / "dir" / "escape").symlink_to(victim)
    safefs.chown_tree(base, "", 4242, 4242)
    assert os.stat(victim).st_uid != 4242 and os.lstat(base / "dir" / "escape").st_uid == 4242
    safefs.rmtree(base)
    assert not base.exists() and victim.read_text() == "untouched"


async def test_provision_and_release_do_not_follow_links_in_home(process_host: Host, tmp_path: Path) -> None:
    h = process_host
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep")
    vol = str(uuid.uuid4())
    p = h.payload("uma", [0], volumes=[{"volume_id": vol, "mount_path": "/data/vol"}])
    await h.task("provision", p)
    ws = h.agent.workspaces.get(p["allocation_id"])
    assert (ws.home / "data" / "vol").resolve() == h.agent.workspaces.volumes_root / vol
    # The user swaps ~/.gpuaas and ~/data for links out of the allocation, then asks for a resize.
    os.unlink(ws.home / ".gpuaas")
    (ws.home / ".gpuaas").symlink_to(outside / "keep")
    (ws.home / "data" / "vol").unlink()
    (ws.home / "data").rmdir()
    (ws.home / "data").symlink_to(outside, target_is_directory=True)
    with pytest.raises(safefs.UnsafePath):
        await h.task("resize", {**p, "gpu_indices": [1]})
    assert (outside / "keep").read_text() == "keep" and sorted(x.name for x in outside.iterdir()) == ["keep"]
    await h.task("release", p)
    assert (outside / "keep").read_text() == "keep"
    assert (h.agent.workspaces.volumes_root / vol).is_dir()  # a volume's data outlives the release


def test_hostnames_differ_for_allocations_created_in_the_same_instant(tmp_path: Path) -> None:
    """Issue 33: ids are time-ordered, so a hostname from their head was shared by a minute's allocations."""
    from gpuaas.contracts.envelope import new_event_id
    from gpuaas.node_agent.drivers.container import ContainerDriver
    from gpuaas.node_agent.workspace import Workspace

    ids = [str(new_event_id()) for _ in range(200)]
    assert len({i[:8] for i in ids}) < 200  # the old scheme's input: heads collide within one instant
    names = {ContainerDriver.hostname(Workspace(i, tmp_path / i)) for i in ids}
    assert len(names) == 200 and all(len(n) <= 63 for n in names)  # unique and a valid DNS label


def test_a_resize_that_sends_no_overlay_keeps_the_allocations_segment(tmp_path: Path) -> None:
    """The console's e2e: a resize task serialised `overlay: null`, the agent took it as "no overlay", recreated the
    container off its segment, and the project's next member found the network on another subnet."""
    from gpuaas.contracts.agent import ResizeTask
    from gpuaas.node_agent.agent import Agent
    from gpuaas.node_agent.workspace import Workspace

    segment = {
        "project_id": "01a21d70-31ca-7d92-b0f0-a15633662796",
        "vni": 1048576,
        "subnet": "10.208.0.0/24",
        "address": "10.208.0.2",
        "underlay": "198.18.0.1",
        "peers": [{"underlay": "198.18.0.1", "addresses": ["10.208.0.2"]}],
        "names": {"a.p-01a21d7031ca": "10.208.0.2"},
    }
    ws = Workspace("01a21d71-328d-7a0e-95df-6b6076f22003", tmp_path)
    ws.write_meta(overlay=segment, gpu_indices=[0])
    base = {"allocation_id": ws.allocation_id, "username": "a1", "gpu_indices": [0, 1]}
    Agent._update(ws, ResizeTask.model_validate({**base, "overlay": None}))
    assert ws.meta["overlay"]["address"] == "10.208.0.2" and ws.meta["gpu_indices"] == [0, 1]
    moved = {**segment, "names": {"a.p-01a21d7031ca": "10.208.0.2", "b.p-01a21d7031ca": "10.208.0.3"}}
    Agent._update(ws, ResizeTask.model_validate({**base, "overlay": moved}))
    assert ws.meta["overlay"]["names"] == moved["names"]  # a segment that was sent is taken
