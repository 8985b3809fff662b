"""Allocation rules without I/O (gpuaas.allocations.domain) not covered by test_isolation_rules and
test_capacity_window: the lifecycle table, placement (which host, which GPUs), SSH public keys, Unix names."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable

import asyncssh
import pytest

from gpuaas.allocations import domain
from gpuaas.allocations.domain import HostCapacity
from gpuaas.contracts.enums import AllocationStatus, CapacityShape
from gpuaas.kit.problems import Problem

S = AllocationStatus
H100, A100 = "H100-80GB", "A100-40GB"


# --------------------------------------------------------------------------------------------- lifecycle


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (S.requested, S.provisioning),
        (S.requested, S.queued),  # no capacity now: it waits (issue 29)
        (S.provisioning, S.active),
        (S.provisioning, S.failed),
        (S.active, S.restarting),
        (S.restarting, S.active),
        (S.active, S.resizing),
        (S.resizing, S.active),
        (S.active, S.releasing),
        (S.resizing, S.releasing),  # a release does not wait for a resize
        (S.releasing, S.released),
        (S.releasing, S.release_failed),
        (S.release_failed, S.releasing),  # the release is retried
    ],
)
def test_allocation_moves_on_the_lifecycle(current: S, target: S) -> None:
    domain.check_transition(current.value, target, action="move")


@pytest.mark.parametrize(
    ("current", "target", "action"),
    [
        (S.requested, S.active, "activate"),  # provisioning first
        (S.provisioning, S.releasing, "release"),
        (S.restarting, S.resizing, "resize"),  # one operation at a time
        (S.resizing, S.restarting, "restart"),
        (S.releasing, S.active, "restart"),
        (S.release_failed, S.active, "restart"),
        (S.released, S.releasing, "release"),
        (S.failed, S.provisioning, "provision"),
    ],
)
def test_moves_off_the_lifecycle_are_409_naming_the_action_and_status(current: S, target: S, action: str) -> None:
    with pytest.raises(Problem) as caught:
        domain.check_transition(current.value, target, action=action)
    problem = caught.value
    assert (problem.status, problem.code) == (409, "invalid_state_transition")
    assert problem.extra == {"current_status": current.value, "requested": target.value}
    assert action in problem.detail and current.value in problem.detail


def test_released_and_failed_are_final_and_hold_no_capacity() -> None:
    for final in (S.released, S.failed):
        assert final in domain.TERMINAL and final not in domain.HOLDS_CAPACITY
        for target in S:
            with pytest.raises(Problem):
                domain.check_transition(final.value, target, action="move")
    # every other status still holds its GPUs, a failed release included (the host is not known to be clean),
    # except a request waiting in the capacity queue: it holds nothing until admitted
    assert set(S) - domain.TERMINAL - {S.queued} == domain.HOLDS_CAPACITY
    assert S.queued not in domain.HOLDS_CAPACITY


@pytest.mark.parametrize(
    ("target", "allowed"),
    [(S.provisioning, True), (S.failed, True), (S.released, True), (S.active, False), (S.releasing, False)],
)
def test_a_queued_request_is_admitted_failed_or_cancelled_only(target: S, allowed: bool) -> None:
    if allowed:
        domain.check_transition(S.queued.value, target, action="move")
    else:
        with pytest.raises(Problem):
            domain.check_transition(S.queued.value, target, action="move")


@pytest.mark.parametrize(
    ("figures", "code"),
    [
        ({"guarantee": 5, "limit": 4, "lend_limit": None, "weight": 1.0}, "guarantee_above_limit"),
        ({"guarantee": -1, "limit": None, "lend_limit": None, "weight": 1.0}, "invalid_queue"),
        ({"guarantee": 2, "limit": None, "lend_limit": 3, "weight": 1.0}, "invalid_queue"),
        ({"guarantee": 0, "limit": None, "lend_limit": None, "weight": 0.0}, "invalid_queue"),
    ],
)
def test_bad_queue_figures_are_422(figures: dict, code: str) -> None:
    with pytest.raises(Problem) as caught:
        domain.check_queue_figures(**figures)
    assert (caught.value.status, caught.value.code) == (422, code)


def test_projects_share_no_more_than_their_tenant() -> None:
    domain.check_project_share(tenant_guarantee=4, tenant_limit=8, other_projects_guarantee=3, guarantee=1, limit=8)
    with pytest.raises(Problem) as caught:
        domain.check_project_share(
            tenant_guarantee=4, tenant_limit=None, other_projects_guarantee=3, guarantee=2, limit=None
        )
    assert caught.value.code == "project_guarantees_above_tenant"
    with pytest.raises(Problem) as caught:
        domain.check_project_share(tenant_guarantee=4, tenant_limit=8, other_projects_guarantee=0, guarantee=0, limit=9)
    assert caught.value.code == "project_limit_above_tenant"


# --------------------------------------------------------------------------------------------- placement


def host(
    name: str,
    gpus: dict[str, list[int]] | None = None,
    used: set[int] = frozenset(),
    status: str = "ready",
    host_class: str | None = None,
) -> HostCapacity:
    return HostCapacity(
        uuid.uuid4(), name, status, host_class, gpus if gpus is not None else {H100: list(range(8))}, frozenset(used)
    )


def names(hosts: list[HostCapacity]) -> list[str]:
    return [h.name for h in hosts]


def test_a_slice_goes_to_the_host_it_fills_best() -> None:
    hosts = [host("empty"), host("half", used={0, 1, 2, 3}), host("nearly-full", used=set(range(6)))]
    fit = domain.candidates(hosts, shape=CapacityShape.gpu_slice, model=H100, count=2, host_class=None)
    assert names(fit) == ["nearly-full", "half", "empty"]  # fewest GPUs left over first: big holes stay
    fit = domain.candidates(hosts, shape=CapacityShape.gpu_slice, model=H100, count=3, host_class=None)
    assert names(fit) == ["half", "empty"]


def test_equal_fits_are_ordered_by_name_for_a_stable_choice() -> None:
    hosts = [host("b"), host("a"), host("c")]
    assert names(domain.candidates(hosts, shape=CapacityShape.gpu_slice, model=H100, count=1, host_class=None)) == [
        "a",
        "b",
        "c",
    ]


def test_only_ready_hosts_of_the_model_and_class_asked_for_are_candidates() -> None:
    hosts = [
        host("enrolling", status="enrolling"),
        host("cordoned", status="cordoned"),
        host("unreachable", status="unreachable"),
        host("a100", gpus={A100: [0, 1]}),
        host("other-class", host_class="container"),
        host("fits", host_class="process"),
    ]
    fit = domain.candidates(hosts, shape=CapacityShape.gpu_slice, model=H100, count=1, host_class="process")
    assert names(fit) == ["fits"]
    any_class = domain.candidates(hosts, shape=CapacityShape.gpu_slice, model=H100, count=1, host_class=None)
    assert names(any_class) == ["fits", "other-class"]


def test_baremetal_takes_only_a_whole_idle_host_of_one_model() -> None:
    hosts = [
        host("busy", used={7}),
        host("mixed", gpus={H100: [0, 1], A100: [2, 3]}),  # a whole host is not all of the model asked for
        host("idle"),
        host("none", gpus={}),
    ]
    fit = domain.candidates(hosts, shape=CapacityShape.baremetal, model=H100, count=8, host_class=None)
    assert names(fit) == ["idle"]
    assert domain.pick_gpus(fit[0], shape=CapacityShape.baremetal, model=H100, count=8) == list(range(8))
    assert domain.pick_gpus(hosts[0], shape=CapacityShape.baremetal, model=H100, count=8) is None


def test_a_slice_gets_the_lowest_free_indices_of_its_model() -> None:
    h = host("h", gpus={H100: [4, 0, 6, 2], A100: [1, 3]}, used={0})
    assert domain.pick_gpus(h, shape=CapacityShape.gpu_slice, model=H100, count=2) == [2, 4]
    assert domain.pick_gpus(h, shape=CapacityShape.gpu_slice, model=H100, count=3) == [2, 4, 6]
    assert domain.pick_gpus(h, shape=CapacityShape.gpu_slice, model=H100, count=4) is None  # one is in use
    assert domain.pick_gpus(h, shape=CapacityShape.gpu_slice, model=A100, count=2) == [1, 3]


def test_no_host_fits_more_gpus_than_it_has_free() -> None:
    hosts = [host("h", used=set(range(7)))]
    assert domain.candidates(hosts, shape=CapacityShape.gpu_slice, model=H100, count=2, host_class=None) == []


# ----------------------------------------------------------------------------------------- public keys


@pytest.mark.parametrize("alg", ["ssh-ed25519", "ecdsa-sha2-nistp256", "ssh-rsa"])
def test_a_public_key_line_is_normalised_with_its_openssh_fingerprint(alg: str) -> None:
    key = asyncssh.generate_private_key(alg, comment="me@laptop")
    line = key.export_public_key().decode()
    normalised, fingerprint = domain.parse_public_key("  " + line.replace(" ", "   ", 1) + "\n")
    assert normalised == line.strip()
    assert fingerprint == key.get_fingerprint("sha256")  # what `ssh-keygen -lf` prints


def test_a_key_without_a_comment_is_accepted() -> None:
    key = asyncssh.generate_private_key("ssh-ed25519")
    typ, blob = key.export_public_key().decode().split()[:2]
    assert domain.parse_public_key(f"{typ} {blob}")[0] == f"{typ} {blob}"


def _ed25519_line() -> tuple[str, str]:
    typ, blob = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().split()[:2]
    return typ, blob


@pytest.mark.parametrize(
    "make",
    [
        lambda t, b: "",
        lambda t, b: b,  # no key type
        lambda t, b: f"rsa {b}",  # not an OpenSSH key type
        lambda t, b: f"{t} not*base64!",
        lambda t, b: f"{t} AAAA",  # too short to hold a key
        lambda t, b: f"ssh-rsa {b}",  # the blob is an ed25519 key: the type must match what it holds
        lambda t, b: "-----BEGIN OPENSSH PRIVATE KEY-----",
    ],
)
def test_anything_else_is_invalid_public_key(make: Callable[[str, str], str]) -> None:
    with pytest.raises(Problem) as caught:
        domain.parse_public_key(make(*_ed25519_line()))
    assert (caught.value.status, caught.value.code) == (422, "invalid_public_key")


# ------------------------------------------------------------------------------------------ unix names


def test_the_unix_username_is_a_short_stable_posix_name() -> None:
    ids = [uuid.uuid4() for _ in range(200)]
    usernames = [domain.unix_username(i) for i in ids]
    assert all(re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", u) for u in usernames)  # POSIX portable, under 32
    assert [domain.unix_username(i) for i in ids] == usernames
    assert len(set(usernames)) == len(usernames)


# ------------------------------------------------------------------------------------- after release


def test_what_a_release_keeps_is_said_per_volume() -> None:
    said = domain.allocation_after_release([("datasets", True), ("scratch2", False), ("models", True)])
    assert "volumes kept: datasets, models" in said and "volumes deleted: scratch2" in said
    assert "workspace" in said
    assert "nothing persists" in domain.allocation_after_release([])
    assert "kept" in domain.after_release(True) and "deleted" in domain.after_release(False)
