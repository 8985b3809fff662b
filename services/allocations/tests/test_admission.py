"""The admission engine's rules (gpuaas.allocations.admission, issue 29), pure: guarantees first, weighted
fair share, priority then age, limits, lending, gang placement, preemption victims, FCFS without settings."""

from __future__ import annotations

import itertools
import uuid

import pytest

from gpuaas.allocations import admission, domain
from gpuaas.allocations.admission import (
    AdmissionConfig,
    Plan,
    QueueSettings,
    Running,
    Waiting,
    accrue,
    decay,
    plan,
)
from gpuaas.allocations.domain import HostCapacity
from gpuaas.contracts.enums import CapacityShape

M = "H100-80GB"
_ids = itertools.count(1)
T1, T2, T3 = (uuid.UUID(int=0x1000 + i) for i in range(3))


def uid() -> uuid.UUID:
    return uuid.UUID(int=next(_ids))


def host(name: str, gpus: int = 8, used: tuple[int, ...] = (), cls: str | None = None, status: str = "ready"):
    return HostCapacity(
        uuid.uuid5(uuid.NAMESPACE_DNS, name), name, status, cls, {M: list(range(gpus))}, frozenset(used)
    )


def wait(
    tenant: uuid.UUID,
    project: str | None = None,
    *,
    count: int = 1,
    priority: int = 0,
    at: float = 0.0,
    shape: CapacityShape = CapacityShape.gpu_slice,
    cls: str | None = None,
) -> Waiting:
    return Waiting(uid(), project or f"project:{tenant}", tenant, shape, count, cls, priority, at)


def run(
    tenant: uuid.UUID, h: HostCapacity, *, gpus: int = 1, priority: int = 0, started: float = 0.0, project: str = ""
) -> Running:
    return Running(uid(), project or f"project:{tenant}", gpus, priority, started, host_id=h.host_id, tenant_id=tenant)


def tq(tenant: uuid.UUID, **kw: object) -> QueueSettings:
    return QueueSettings(f"tenant:{tenant}", None, **kw)  # pyright: ignore[reportArgumentType]


def pq(project: str, tenant: uuid.UUID, **kw: object) -> QueueSettings:
    return QueueSettings(project, f"tenant:{tenant}", **kw)  # pyright: ignore[reportArgumentType]


def settings(*qs: QueueSettings) -> dict[str, QueueSettings]:
    return {q.queue_id: q for q in qs}


def admitted(p: Plan) -> list[uuid.UUID]:
    return [a.allocation_id for a in p.admissions]


def reasons(p: Plan) -> dict[uuid.UUID, str]:
    return {x.allocation_id: x.reason for x in p.pending}


NOW = 10_000.0


def go(hosts, waiting, running=(), queues=None, **kw) -> Plan:
    return plan(model=M, queues=queues or {}, running=running, waiting=waiting, hosts=hosts, now=NOW, **kw)


# --------------------------------------------------------------------------------------- no settings


def test_without_settings_it_is_first_come_first_served_by_priority_then_age_and_the_rest_waits() -> None:
    h = host("a", gpus=2)
    late_high, early, late = wait(T1, priority=5, at=30), wait(T2, at=10), wait(T3, at=20)
    p = go([h], [late, early, late_high])
    assert admitted(p) == [late_high.allocation_id, early.allocation_id]  # no fair share across tenants
    assert {a.gpu_indices for a in p.admissions} == {(0,), (1,)}
    assert reasons(p) == {late.allocation_id: "no_capacity"}
    assert p.pending[0].position == 1
    assert not p.preemptions


def test_a_request_too_big_to_place_does_not_block_smaller_ones_behind_it() -> None:
    big, small_same, small_other = wait(T1, count=4, at=1), wait(T1, at=2), wait(T2, at=3)
    p = go([host("a", gpus=4, used=(0, 1))], [big, small_same, small_other])
    assert set(admitted(p)) == {small_same.allocation_id, small_other.allocation_id}
    assert reasons(p) == {big.allocation_id: "no_capacity"}


def test_positions_are_per_project_by_priority_then_age() -> None:
    p = go(
        [host("a", gpus=1, used=(0,))], [w1 := wait(T1, at=5), w2 := wait(T1, at=1), w3 := wait(T1, priority=1, at=9)]
    )
    pos = {x.allocation_id: x.position for x in p.pending}
    assert pos == {w3.allocation_id: 1, w2.allocation_id: 2, w1.allocation_id: 3}


# ------------------------------------------------------------------------------------------ placement


def test_best_fit_as_domain_candidates_and_gang_on_one_host() -> None:
    hosts = [host("a", gpus=4, used=(0,)), host("b", gpus=4, used=(0, 1)), host("c", gpus=4, used=(0, 1, 2))]
    two, three = wait(T1, count=2, at=1), wait(T2, count=3, at=2)
    p = go(hosts, [two, three])
    by = {a.allocation_id: a for a in p.admissions}
    expected = domain.candidates(hosts, shape=CapacityShape.gpu_slice, model=M, count=2, host_class=None)[0]
    assert by[two.allocation_id].host_id == expected.host_id == hosts[1].host_id
    assert by[two.allocation_id].gpu_indices == (2, 3)
    assert by[three.allocation_id].host_id == hosts[0].host_id  # the only host with 3 free GPUs

    split = wait(T1, count=3)  # 2 + 2 free on two hosts: never split across hosts
    p = go([host("x", gpus=4, used=(0, 1)), host("y", gpus=4, used=(0, 1))], [split])
    assert not p.admissions and reasons(p) == {split.allocation_id: "no_capacity"}


def test_admissions_in_one_plan_never_book_a_gpu_twice() -> None:
    hosts = [host("a", gpus=4, used=(1,)), host("b", gpus=2)]
    reqs = [wait(T1, count=c, at=i) for i, c in enumerate([1, 2, 1, 1, 2, 1])]
    p = go(hosts, reqs)
    held = [(a.host_id, g) for a in p.admissions for g in a.gpu_indices]
    assert len(held) == len(set(held)) == 5  # 3 + 2 free GPUs, all used, none twice
    assert (hosts[0].host_id, 1) not in held


def test_host_class_cordoned_hosts_and_other_models_are_respected() -> None:
    hosts = [
        host("a", cls="small"),
        host("b", cls="big", status="cordoned"),
        HostCapacity(uuid.uuid4(), "c", "ready", "big", {"A100-40GB": [0, 1]}, frozenset()),
    ]
    big, small = wait(T1, cls="big"), wait(T1, cls="small", at=1)
    p = go(hosts, [big, small])
    assert admitted(p) == [small.allocation_id]
    assert reasons(p) == {big.allocation_id: "no_capacity"}


def test_baremetal_takes_a_whole_unused_host_and_counts_all_its_gpus() -> None:
    hosts = [host("a", gpus=4, used=(0,)), host("b", gpus=4)]
    whole, whole2 = wait(T1, shape=CapacityShape.baremetal), wait(T2, shape=CapacityShape.baremetal, at=1)
    p = go(hosts, [whole, whole2], queues=settings(pq("project:lim", T2, limit=3)))
    assert p.admissions == (admission.Admission(whole.allocation_id, hosts[1].host_id, (0, 1, 2, 3)),)
    assert reasons(p) == {whole2.allocation_id: "no_capacity"}


# ------------------------------------------------------------------------------------------- limits


def test_project_and_tenant_limits_are_never_exceeded_and_smaller_requests_still_go() -> None:
    queues = settings(pq("project:p", T1, limit=3), tq(T2, limit=2))
    h = host("a")
    running = [run(T1, h, gpus=2, project="project:p"), run(T2, h, gpus=1)]
    h = host("a", used=(0, 1, 2))
    over_p, fits_p = wait(T1, "project:p", count=2, at=1), wait(T1, "project:p", at=2)
    over_t, fits_t = wait(T2, count=2, at=3), wait(T2, at=4)
    after = wait(T2, at=5)
    p = go([h], [over_p, fits_p, over_t, fits_t, after], running, queues=queues)
    assert set(admitted(p)) == {fits_p.allocation_id, fits_t.allocation_id}
    assert reasons(p) == {
        over_p.allocation_id: "over_limit",
        over_t.allocation_id: "over_tenant_limit",
        after.allocation_id: "over_tenant_limit",  # the tenant is at its limit once fits_t is in
    }


# -------------------------------------------------------------------------------- guarantee and shares


def test_guarantee_goes_before_older_borrowers() -> None:
    queues = settings(tq(T1, guarantee=2), tq(T2, weight=10.0))
    borrower, owner = wait(T2, at=1), wait(T1, at=50)
    p = go([host("a", gpus=1)], [borrower, owner], queues=queues)
    assert admitted(p) == [owner.allocation_id]


@pytest.mark.parametrize(("a_held", "winner"), [(4, "A"), (6, "B")])
def test_weighted_share_after_admission_picks_the_next_queue(a_held: int, winner: str) -> None:
    """A weight 2, B weight 1, B holds 2: A holding 4 has (4+1)/2 = 2.5 < (2+1)/1 = 3; holding 6, 3.5 > 3."""
    queues = settings(tq(T1, weight=2.0), tq(T2, weight=1.0))
    h = host("a", gpus=a_held + 3)
    running = [run(T1, h) for _ in range(a_held)] + [run(T2, h) for _ in range(2)]
    h = host("a", gpus=a_held + 3, used=tuple(range(a_held + 2)))
    a, b = wait(T1, at=100), wait(T2, at=200)
    p = go([h], [a, b], running, queues=queues)
    assert admitted(p) == [a.allocation_id if winner == "A" else b.allocation_id]


def test_weights_divide_the_surplus_above_guarantees() -> None:
    """A guarantee 4 holding 5, B guarantee 0 holding 2, equal weight: A's surplus after is 2, B's 3."""
    queues = settings(tq(T1, guarantee=4), tq(T2))
    h = host("a", gpus=8)
    running = [run(T1, h) for _ in range(5)] + [run(T2, h) for _ in range(2)]
    a, b = wait(T1, at=9), wait(T2, at=1)
    p = go([host("a", gpus=8, used=tuple(range(7)))], [a, b], running, queues=queues)
    assert admitted(p) == [a.allocation_id]


def test_projects_share_their_tenant_by_weight() -> None:
    queues = settings(pq("project:x", T1, weight=3.0), pq("project:y", T1, weight=1.0), tq(T1, weight=2.0))
    waiting = [wait(T1, "project:x", at=i) for i in range(8)] + [wait(T1, "project:y", at=i) for i in range(8)]
    p = go([host("a", gpus=8)], waiting, queues=queues)
    got = [w.queue_id for w in waiting if w.allocation_id in set(admitted(p))]
    assert got.count("project:x") == 6 and got.count("project:y") == 2


def test_priority_then_age_inside_a_queue() -> None:
    queues = settings(tq(T1, weight=2.0))
    old, high, young = wait(T1, at=1), wait(T1, priority=3, at=5), wait(T1, at=3)
    p = go([host("a", gpus=2)], [young, old, high], queues=queues)
    assert admitted(p) == [high.allocation_id, old.allocation_id]


def test_decayed_usage_favours_the_queue_that_used_less_lately() -> None:
    queues = settings(tq(T1), tq(T2), pq("project:b", T2, weight=1.0))
    a, b = wait(T1, at=1), wait(T2, "project:b", at=2)
    config = AdmissionConfig(usage_half_life=3600.0)
    lots = {f"tenant:{T1}": 10 * 3600.0}
    p = go([host("a", gpus=1)], [a, b], queues=queues, decayed_usage=lots, config=config)
    assert admitted(p) == [b.allocation_id]
    p = go([host("a", gpus=1)], [a, b], queues=queues, decayed_usage={f"tenant:{T2}": 10 * 3600.0}, config=config)
    assert admitted(p) == [a.allocation_id]


def test_decay_halves_per_half_life_and_accrual_does_not_depend_on_the_step() -> None:
    assert decay(100.0, 3600.0, 3600.0) == pytest.approx(50.0)
    assert decay(100.0, 0.0, 3600.0) == 100.0
    one = accrue(500.0, 3, 7200.0, 1800.0)
    many = 500.0
    for _ in range(72):
        many = accrue(many, 3, 100.0, 1800.0)
    assert one == pytest.approx(many)
    assert accrue(0.0, 2, 1e9, 1800.0) == pytest.approx(2 * 1800.0 / 0.6931471805599453)


def test_lend_limit_keeps_the_unlendable_part_of_an_idle_guarantee_free() -> None:
    waiting = [wait(T2, at=i) for i in range(8)]
    p = go([host("a")], waiting, queues=settings(tq(T1, guarantee=4, lend_limit=1), tq(T2)))
    assert len(p.admissions) == 5  # 8 free - (4 unused - 1 lendable)
    assert set(reasons(p).values()) == {"no_capacity"}
    p = go([host("a")], waiting, queues=settings(tq(T1, guarantee=4), tq(T2)))
    assert len(p.admissions) == 8  # lend_limit None: all of it may be borrowed (and reclaimed)
    owner = wait(T1, count=3, at=99)
    p = go([host("a")], [*waiting, owner], queues=settings(tq(T1, guarantee=4, lend_limit=1), tq(T2)))
    assert owner.allocation_id in admitted(p) and len(p.admissions) == 6


# ---------------------------------------------------------------------------------------- preemption


def full_host_of_borrowers(name: str = "a", *, started: float = 0.0) -> tuple[HostCapacity, list[Running]]:
    h = host(name)
    running = [run(T2, h, priority=i % 2, started=started + i) for i in range(8)]
    return host(name, used=tuple(range(8))), running


def test_a_queue_below_its_guarantee_preempts_borrowers_lowest_priority_youngest_first() -> None:
    h, running = full_host_of_borrowers()
    owner = wait(T1, count=3, at=1)
    p = go([h], [owner], running, queues=settings(tq(T1, guarantee=4)))
    assert not p.admissions
    assert reasons(p) == {owner.allocation_id: "waiting_for_preemption"}
    victims = [x.victim_id for x in p.preemptions]
    priority0 = sorted((r for r in running if r.priority == 0), key=lambda r: -r.started_at)
    assert victims == [r.allocation_id for r in priority0[:3]]
    assert {x.for_allocation_id for x in p.preemptions} == {owner.allocation_id}
    assert {x.reason for x in p.preemptions} == {"reclaim_guarantee"}


def test_no_preemption_before_min_runtime_or_of_work_inside_its_guarantee_or_unpreemptible() -> None:
    owner = wait(T1, count=3, at=1)
    h, young = full_host_of_borrowers(started=NOW - 100)
    p = go([h], [owner], young, queues=settings(tq(T1, guarantee=4)))
    assert not p.preemptions and reasons(p) == {owner.allocation_id: "no_capacity"}

    h, running = full_host_of_borrowers()
    p = go([h], [owner], running, queues=settings(tq(T1, guarantee=4), tq(T2, guarantee=6)))
    assert not p.preemptions  # only 2 of T2's 8 are above its guarantee of 6
    two = wait(T1, count=2, at=1)
    p = go([h], [two], running, queues=settings(tq(T1, guarantee=4), tq(T2, guarantee=6)))
    assert len(p.preemptions) == 2

    fixed = [Running(r.allocation_id, r.queue_id, r.gpus, r.priority, r.started_at, False, r.host_id) for r in running]
    p = go([h], [owner], fixed, queues=settings(tq(T1, guarantee=4)))
    assert not p.preemptions
    p = go([h], [owner], running, queues=settings(tq(T1, guarantee=4)), config=AdmissionConfig(preemption=False))
    assert not p.preemptions


def test_a_borrower_without_guarantee_never_preempts() -> None:
    h, running = full_host_of_borrowers()
    p = go([h], [wait(T3, at=1)], running, queues=settings(tq(T3, weight=5.0)))
    assert not p.preemptions


def test_victims_are_on_one_host_enough_for_the_whole_request() -> None:
    hosts = [host("a", gpus=2), host("b", gpus=2)]
    running = [run(T2, h) for h in hosts for _ in range(2)]
    hosts = [host("a", gpus=2, used=(0, 1)), host("b", gpus=2, used=(0, 1))]
    owner3, owner2 = wait(T1, count=3, at=1), wait(T1, count=2, at=2)
    p = go(hosts, [owner3], running, queues=settings(tq(T1, guarantee=4)))
    assert not p.preemptions  # 4 borrowed GPUs, but no host can give 3
    p = go(hosts, [owner2], running, queues=settings(tq(T1, guarantee=4)))
    victims = {r.allocation_id: r for r in running}
    assert len({victims[x.victim_id].host_id for x in p.preemptions}) == 1 and len(p.preemptions) == 2


def test_victims_already_reserved_are_not_chosen_again_and_their_beneficiary_waits() -> None:
    h, running = full_host_of_borrowers()
    first, second = wait(T1, count=2, at=1), wait(T1, count=2, at=2)
    queues = settings(tq(T1, guarantee=4))
    p1 = go([h], [first], running, queues=queues)
    reserved = {x.victim_id: x.for_allocation_id for x in p1.preemptions}
    p2 = go([h], [first, second], running, queues=queues, reserved_for=reserved)
    assert reasons(p2)[first.allocation_id] == "waiting_for_preemption"
    assert all(x.for_allocation_id == second.allocation_id for x in p2.preemptions)
    assert not set(reserved) & {x.victim_id for x in p2.preemptions} and len(p2.preemptions) == 2


def test_freed_gpus_go_to_the_request_they_were_freed_for() -> None:
    h, running = full_host_of_borrowers()
    owner = wait(T1, count=2, at=500)
    queues = settings(tq(T1, guarantee=4), tq(T2, weight=100.0))
    p1 = go([h], [owner], running, queues=queues)
    gone = {x.victim_id for x in p1.preemptions}
    still = [r for r in running if r.allocation_id not in gone]
    freed = host("a", used=tuple(i for i in range(8) if running[i].allocation_id not in gone))
    older = wait(T2, count=2, at=0)  # older, and T2's weight is huge
    p2 = go([freed], [older, owner], still, queues=queues, reserved_for={v: owner.allocation_id for v in gone})
    assert admitted(p2) == [owner.allocation_id]


def test_project_guarantee_reclaims_from_a_sibling_project_over_its_own() -> None:
    h = host("a")
    running = [run(T1, h, project="project:y", started=i) for i in range(8)]
    queues = settings(tq(T1, guarantee=8), pq("project:x", T1, guarantee=4), pq("project:y", T1, guarantee=4))
    owner = wait(T1, "project:x", count=4)
    p = go([host("a", used=tuple(range(8)))], [owner], running, queues=queues)
    assert len(p.preemptions) == 4
    assert reasons(p) == {owner.allocation_id: "waiting_for_preemption"}


def test_gpus_freed_by_some_victims_are_held_back_until_the_last_one_stops() -> None:
    h, running = full_host_of_borrowers()
    owner = wait(T1, count=3, at=500)
    queues = settings(tq(T1, guarantee=4), tq(T2))
    reserved = {x.victim_id: x.for_allocation_id for x in go([h], [owner], running, queues=queues).preemptions}
    first_gone = next(iter(reserved))
    still = [r for r in running if r.allocation_id != first_gone]
    freed = host("a", used=tuple(i for i in range(8) if running[i].allocation_id != first_gone))
    other = wait(T2, at=0)
    p = go([freed], [other, owner], still, queues=queues, reserved_for=reserved)
    assert not p.admissions and not p.preemptions  # the freed GPU waits for `owner`; no second preemption
    assert reasons(p) == {owner.allocation_id: "waiting_for_preemption", other.allocation_id: "no_capacity"}


def test_a_beneficiary_whose_freed_gpus_were_lost_may_preempt_again() -> None:
    h, running = full_host_of_borrowers()
    owner = wait(T1, count=2, at=500)
    queues = settings(tq(T1, guarantee=4))
    stale = {uid(): owner.allocation_id}  # its victims stopped, yet the host is full again
    p = go([h], [owner], running, queues=queues, reserved_for=stale)
    assert len(p.preemptions) == 2 and reasons(p) == {owner.allocation_id: "waiting_for_preemption"}


def test_with_weights_a_blocked_head_does_not_block_other_queues_or_smaller_requests_behind_it() -> None:
    queues = settings(tq(T1, weight=2.0), tq(T2))
    big, small = wait(T1, count=8, at=1), wait(T1, at=2)
    other = wait(T2, at=3)
    p = go([host("a", gpus=4, used=(0, 1))], [big, small, other], queues=queues)
    assert set(admitted(p)) == {small.allocation_id, other.allocation_id}
    assert reasons(p) == {big.allocation_id: "no_capacity"}


def test_a_waiting_resize_grows_only_on_its_own_host_and_never_preempts() -> None:
    own, roomy = host("own", 2, used=(0, 1)), host("roomy", 8)
    holder = run(T1, own, gpus=1)
    resize = Waiting(holder.allocation_id, holder.queue_id, T1, CapacityShape.gpu_slice, 1, None, 0, 0.0, own.host_id)
    guaranteed = settings(tq(T1, guarantee=4), tq(T2))
    p = plan(
        model=M,
        queues=guaranteed,
        running=[holder, run(T2, own, gpus=1)],
        waiting=[resize],
        hosts=[own, roomy],
        now=NOW,
    )
    assert admitted(p) == [] and reasons(p) == {resize.allocation_id: "no_capacity"} and p.preemptions == ()
    freed = host("own", 2, used=(0,))
    p = plan(model=M, queues={}, running=[holder], waiting=[resize], hosts=[freed, roomy], now=NOW)
    assert [(a.host_id, a.gpu_indices) for a in p.admissions] == [(own.host_id, (1,))]
