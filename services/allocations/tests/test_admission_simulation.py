"""The admission engine over simulated hours (gpuaas.allocations.simulation drives the real `admission.plan`,
as bench/capacity.py does): weighted shares converge to their targets, a guarantee is reclaimed within the
victims' grace, and randomized scenarios never break the safety rules the simulator verifies every cycle."""

from __future__ import annotations

import random
import uuid

import pytest

from gpuaas.allocations.admission import AdmissionConfig, QueueSettings
from gpuaas.allocations.simulation import Figures, Scenario, Workload, simulate

A, B, G = (uuid.UUID(int=0xA000 + n) for n in range(3))


def conserved(f: Figures) -> bool:
    return f.submitted == f.finished + f.cancelled + f.waiting_at_end + f.running_at_end


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_weights_2_and_1_saturating_12_gpus_share_8_and_4_over_six_hours(seed: int) -> None:
    queues = {
        f"tenant:{A}": QueueSettings(f"tenant:{A}", None, weight=2.0),
        f"tenant:{B}": QueueSettings(f"tenant:{B}", None, weight=1.0),
    }
    workloads = (
        Workload("project:a", A, backlog=20, mean_lifetime=900.0),  # 1-GPU, exponential lifetimes
        Workload("project:b", B, backlog=20, mean_lifetime=900.0),
    )
    f = simulate(Scenario(queues, workloads, hosts=3, gpus_per_host=4, duration=6 * 3600.0, seed=seed))
    assert f.violations == []
    assert f.finished > 200  # many lifetimes ended: the share was re-decided many times
    assert f.held_avg[f"tenant:{A}"] == pytest.approx(8, rel=0.05)
    assert f.held_avg[f"tenant:{B}"] == pytest.approx(4, rel=0.05)
    assert conserved(f)


def test_without_settings_the_pool_is_first_come_first_served_and_full() -> None:
    workloads = (Workload("project:a", A, backlog=5), Workload("project:b", B, backlog=5))
    f = simulate(Scenario({}, workloads, hosts=2, gpus_per_host=4, duration=3 * 3600.0))
    assert f.violations == [] and f.preemptions == 0
    assert f.utilisation > 0.99


def test_an_idle_guarantee_is_reclaimed_within_the_grace_once_borrowers_ran_min_runtime() -> None:
    queues = {f"tenant:{G}": QueueSettings(f"tenant:{G}", None, guarantee=8)}
    workloads = (
        Workload("project:g", G, mean_interarrival=3600.0, gpus=(4,), mean_lifetime=600.0),
        Workload("project:a", A, backlog=10, gpus=(1, 2), mean_lifetime=7200.0),
        Workload("project:b", B, backlog=10, gpus=(1, 2), mean_lifetime=7200.0),
    )
    config = AdmissionConfig(min_runtime=300.0)
    f = simulate(Scenario(queues, workloads, hosts=2, gpus_per_host=8, grace=20.0, config=config, seed=4))
    assert f.violations == []
    waits = f.waits_by_queue["project:g"]
    assert len(waits) >= 3 and f.preemptions > 0
    # the borrowers were admitted at t=0: after their min_runtime a guaranteed request waits the grace, no more
    late = [w for w in f.waits_by_queue["project:g"] if w > 20.0 + 1e-6]
    assert len(late) <= 1, waits  # at most one arrival inside the first min_runtime


def random_scenario(seed: int) -> Scenario:
    rng = random.Random(seed)
    hosts = rng.randint(3, 8)
    gpus = rng.choice([4, 8])
    pool = hosts * gpus
    queues: dict[str, QueueSettings] = {}
    workloads: list[Workload] = []
    left = pool
    for t in range(rng.randint(2, 4)):
        tid = uuid.UUID(int=0xB000 + t)
        g = rng.choice([0, 0, rng.randint(0, max(0, left // 2))])
        left -= g
        tq = f"tenant:{tid}"
        queues[tq] = QueueSettings(
            tq,
            None,
            guarantee=g,
            limit=rng.choice([None, max(g, rng.randint(1, pool))]),
            lend_limit=rng.choice([None, None, rng.randint(0, max(g, 1))]),
            weight=rng.choice([1.0, 2.0, 3.0]),
        )
        for j in range(rng.randint(1, 3)):
            pid = f"project:{t}-{j}"
            pg = rng.choice([0, rng.randint(0, g)]) if g else 0
            queues[pid] = QueueSettings(pid, tq, guarantee=pg, limit=rng.choice([None, max(pg, rng.randint(1, pool))]))
            workloads.append(
                Workload(
                    pid,
                    tid,
                    mean_interarrival=rng.choice([60.0, 180.0, 600.0]),
                    gpus=tuple(rng.sample([1, 2, 4, gpus], rng.randint(1, 3))),
                    baremetal=rng.choice([0.0, 0.1]),
                    mean_lifetime=rng.choice([300.0, 1200.0, 3600.0]),
                    priorities=(0, 1, 2),
                    host_class=rng.choice([None, None, "big"]),
                    on_preempt=rng.choice(["requeue", "release"]),
                    cancel=rng.choice([0.0, 0.2]),
                )
            )
    config = AdmissionConfig(
        min_runtime=rng.choice([0.0, 120.0, 600.0]),
        usage_half_life=rng.choice([None, 1800.0]),
        preemption=rng.random() < 0.8,
    )
    return Scenario(
        queues,
        tuple(workloads),
        hosts=hosts,
        gpus_per_host=gpus,
        host_classes=(None, "big"),
        duration=2 * 3600.0,
        grace=rng.choice([10.0, 60.0]),
        resync=120.0,
        cordon_every=rng.choice([None, 900.0]),
        config=config,
        seed=seed,
    )


def test_random_scenarios_never_double_book_exceed_a_limit_admit_unplaced_or_lose_a_request() -> None:
    """12 seeded scenarios (guarantees, lend limits, limits, weights, priorities, host classes, whole hosts,
    cancels, cordons, preemption with requeue or release): every cycle verified by the simulator."""
    cycles = admissions = preemptions = cancelled = 0
    for seed in range(12):
        sc = random_scenario(seed)
        f = simulate(sc)
        assert f.violations == [], (seed, f.violations[:5])
        assert conserved(f), seed
        cycles += f.cycles
        admissions += f.admissions
        preemptions += f.preemptions
        cancelled += f.cancelled
    # the scenarios did exercise what they claim to
    assert cycles > 3000 and admissions > 1000 and preemptions > 20 and cancelled > 20
