"""A discrete-event simulator around the real admission engine (issue 29): a synthetic fleet and workload on a
simulated clock, `admission.plan` run on every change and on a resync timer, its admissions and preemptions
applied as the service would (a victim gets `grace` seconds, then its GPUs go to the request they were freed
for). Pure: no I/O, seeded, so tests and `bench/capacity.py` share it.

With `check=True` every cycle is verified independently of the engine: no GPU held twice, no admission
without a placement on a ready host that fits the shape, no limit exceeded, every waiting request accounted
for exactly once (admitted or pending with a 1-based position). Violations are collected, not raised, so a
test can print them all.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
import uuid
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from gpuaas.allocations import admission
from gpuaas.allocations.admission import AdmissionConfig, QueueSettings, Running, Waiting
from gpuaas.allocations.domain import HostCapacity
from gpuaas.contracts.enums import CapacityShape, PendingReason
from gpuaas.contracts.events.allocations import HostStatus


@dataclass(frozen=True)
class Workload:
    """One project's demand."""

    queue_id: str  # its project queue: "project:<name>"
    tenant_id: uuid.UUID
    mean_interarrival: float | None = None  # Poisson arrivals; None: saturating (keeps `backlog` waiting)
    backlog: int = 0
    gpus: tuple[int, ...] = (1,)  # request sizes, drawn uniformly
    baremetal: float = 0.0  # share of requests asking for a whole host
    mean_lifetime: float = 1800.0  # exponential lifetimes
    priorities: tuple[int, ...] = (0,)
    host_class: str | None = None
    on_preempt: Literal["requeue", "release"] = "requeue"
    cancel: float = 0.0  # chance that a request is cancelled at a random time while it waits


@dataclass(frozen=True)
class Scenario:
    queues: Mapping[str, QueueSettings]
    workloads: tuple[Workload, ...]
    hosts: int = 2
    gpus_per_host: int = 8
    host_classes: tuple[str | None, ...] = (None,)  # assigned round-robin
    duration: float = 6 * 3600.0
    grace: float = 30.0
    resync: float = 60.0
    cordon_every: float | None = None  # mean seconds between a random host's cordon/uncordon
    config: AdmissionConfig = field(default_factory=AdmissionConfig)
    model: str = "H100-80GB"
    seed: int = 0
    check: bool = True


@dataclass
class Figures:
    duration: float
    held_avg: dict[str, float]  # queue id (project and tenant) -> time-averaged GPUs held
    utilisation: float  # time-averaged GPUs held / GPUs in the pool
    submitted: int = 0
    admissions: int = 0
    preemptions: int = 0
    finished: int = 0
    cancelled: int = 0
    cycles: int = 0
    waits: list[float] = field(default_factory=list)  # enqueue -> admitted, seconds of simulated time
    waits_by_queue: dict[str, list[float]] = field(default_factory=dict)  # project queue -> its waits
    plan_seconds: list[float] = field(default_factory=list)  # wall time of each plan() call
    waiting_at_end: int = 0
    running_at_end: int = 0  # submitted == finished + cancelled + waiting_at_end + running_at_end
    violations: list[str] = field(default_factory=list)


@dataclass
class _Host:
    host_id: uuid.UUID
    name: str
    host_class: str | None
    status: str
    gpus: list[int]
    used: set[int] = field(default_factory=set)


@dataclass
class _Job:
    waiting: Waiting
    lifetime: float  # seconds of work left
    workload: Workload
    queued_at: float  # this time into the queue (a requeued victim keeps its original enqueued_at)


@dataclass
class _Run:
    job: _Job
    running: Running
    host_id: uuid.UUID
    gpus: tuple[int, ...]
    end_at: float
    preempting: bool = False


def simulate(scenario: Scenario) -> Figures:
    return _Sim(scenario).run()


class _Sim:
    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.rng = random.Random(sc.seed)
        self.now = 0.0
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = itertools.count()
        self.hosts = {
            h.host_id: h
            for h in (
                _Host(
                    uuid.UUID(int=i + 1),
                    f"h{i:05d}",
                    sc.host_classes[i % len(sc.host_classes)],
                    HostStatus.ready,
                    list(range(sc.gpus_per_host)),
                )
                for i in range(sc.hosts)
            )
        }
        self.waiting: dict[uuid.UUID, _Job] = {}
        self.running: dict[uuid.UUID, _Run] = {}
        self.reserved_for: dict[uuid.UUID, uuid.UUID] = {}
        self.tenant_of: dict[str, str] = {w.queue_id: f"tenant:{w.tenant_id}" for w in sc.workloads}
        for s in sc.queues.values():
            if s.parent is not None:
                self.tenant_of[s.queue_id] = s.parent
        self.held: dict[str, int] = defaultdict(int)
        self.integral: dict[str, float] = defaultdict(float)
        self.decayed: dict[str, float] = defaultdict(float)
        self.last = 0.0
        self.ids = itertools.count(1)
        self.fig = Figures(duration=sc.duration, held_avg={}, utilisation=0.0)

    # ------------------------------------------------------------------------------------ events

    def at(self, when: float, kind: str, payload: object = None) -> None:
        heapq.heappush(self.events, (when, next(self.seq), kind, payload))

    def run(self) -> Figures:
        sc = self.sc
        for wl in sc.workloads:
            if wl.mean_interarrival is None:
                for _ in range(wl.backlog):
                    self.submit(wl)
            else:
                self.at(self.rng.expovariate(1 / wl.mean_interarrival), "arrive", wl)
        self.at(sc.resync, "resync")
        if sc.cordon_every:
            self.at(self.rng.expovariate(1 / sc.cordon_every), "cordon")
        self.cycle()
        while self.events and self.events[0][0] <= sc.duration:
            when, _, kind, payload = heapq.heappop(self.events)
            self.advance(when)
            self.handle(kind, payload)
            self.cycle()
        self.advance(sc.duration)
        pool = sum(len(h.gpus) for h in self.hosts.values())
        self.fig.held_avg = {q: v / sc.duration for q, v in sorted(self.integral.items())}
        tenants = {q for q in self.integral if q.startswith("tenant:")}
        self.fig.utilisation = sum(self.integral[q] for q in tenants) / sc.duration / pool if pool else 0.0
        self.fig.waiting_at_end = len(self.waiting)
        self.fig.running_at_end = len(self.running)
        return self.fig

    def advance(self, when: float) -> None:
        dt = when - self.last
        if dt > 0:
            hl = self.sc.config.usage_half_life
            for q in set(self.held) | set(self.decayed):
                self.integral[q] += self.held[q] * dt
                if hl:
                    self.decayed[q] = admission.accrue(self.decayed[q], self.held[q], dt, hl)
        self.last = self.now = when

    def handle(self, kind: str, payload: object) -> None:
        if kind == "arrive":
            assert isinstance(payload, Workload)
            self.submit(payload)
            assert payload.mean_interarrival is not None
            self.at(self.now + self.rng.expovariate(1 / payload.mean_interarrival), "arrive", payload)
        elif kind == "end":
            assert isinstance(payload, uuid.UUID)
            run = self.running.get(payload)
            if run is not None and run.end_at <= self.now:
                self.stop(run)
                self.fig.finished += 1
        elif kind == "kill":
            assert isinstance(payload, uuid.UUID)
            run = self.running.get(payload)
            if run is not None:
                self.stop(run)
                if run.job.workload.on_preempt == "requeue":
                    job = run.job
                    job.lifetime = max(1.0, run.end_at - self.now)
                    job.queued_at = self.now
                    self.waiting[job.waiting.allocation_id] = job
                else:
                    self.fig.finished += 1
        elif kind == "cancel":
            assert isinstance(payload, uuid.UUID)
            if self.waiting.pop(payload, None) is not None:
                self.fig.cancelled += 1
                self.drop_reservations(payload)
        elif kind == "cordon":
            host = self.rng.choice(list(self.hosts.values()))
            host.status = HostStatus.cordoned if host.status == HostStatus.ready else HostStatus.ready
            assert self.sc.cordon_every is not None
            self.at(self.now + self.rng.expovariate(1 / self.sc.cordon_every), "cordon")
        elif kind == "resync":
            self.at(self.now + self.sc.resync, "resync")

    def submit(self, wl: Workload) -> None:
        aid = uuid.UUID(int=next(self.ids))
        whole = self.rng.random() < wl.baremetal
        w = Waiting(
            allocation_id=aid,
            queue_id=wl.queue_id,
            tenant_id=wl.tenant_id,
            shape=CapacityShape.baremetal if whole else CapacityShape.gpu_slice,
            count=1 if whole else self.rng.choice(wl.gpus),
            host_class=wl.host_class,
            priority=self.rng.choice(wl.priorities),
            enqueued_at=self.now,
        )
        self.waiting[aid] = _Job(w, self.rng.expovariate(1 / wl.mean_lifetime), wl, self.now)
        self.fig.submitted += 1
        if wl.cancel and self.rng.random() < wl.cancel:
            self.at(self.now + self.rng.expovariate(1 / max(1.0, self.sc.resync)), "cancel", aid)

    def stop(self, run: _Run) -> None:
        del self.running[run.running.allocation_id]
        self.hosts[run.host_id].used -= set(run.gpus)
        self.count(run.running.queue_id, -len(run.gpus))

    def count(self, project: str, gpus: int) -> None:
        self.held[project] += gpus
        self.held[self.tenant_of[project]] += gpus

    def drop_reservations(self, beneficiary: uuid.UUID) -> None:
        for victim in [v for v, b in self.reserved_for.items() if b == beneficiary]:
            del self.reserved_for[victim]

    # ------------------------------------------------------------------------------------- a cycle

    def cycle(self) -> None:
        sc = self.sc
        hosts = [
            HostCapacity(h.host_id, h.name, h.status, h.host_class, {sc.model: h.gpus}, frozenset(h.used))
            for h in self.hosts.values()
        ]
        running = [r.running for r in self.running.values()]
        waiting = [j.waiting for j in self.waiting.values()]
        started = time.perf_counter()
        result = admission.plan(
            model=sc.model,
            queues=sc.queues,
            running=running,
            waiting=waiting,
            hosts=hosts,
            now=self.now,
            decayed_usage=dict(self.decayed) if sc.config.usage_half_life else None,
            reserved_for=dict(self.reserved_for),
            config=sc.config,
        )
        self.fig.plan_seconds.append(time.perf_counter() - started)
        self.fig.cycles += 1
        if sc.check:
            self.verify_accounting(result)
        for a in result.admissions:
            self.admit(a)
        for p in result.preemptions:
            run = self.running.get(p.victim_id)
            if run is None or run.preempting or p.victim_id in self.reserved_for:
                self.fig.violations.append(f"t={self.now:.0f} preempted {p.victim_id}: not running or already")
                continue
            run.preempting = True
            run.running = replace(run.running, preemptible=False)  # being preempted: never a victim again
            self.reserved_for[p.victim_id] = p.for_allocation_id
            self.fig.preemptions += 1
            if self.now - run.running.started_at < sc.config.min_runtime:
                self.fig.violations.append(f"t={self.now:.0f} preempted {p.victim_id} before min_runtime")
            self.at(self.now + sc.grace, "kill", p.victim_id)
        # Saturating workloads keep their backlog waiting.
        short: dict[str, int] = defaultdict(int)
        for job in self.waiting.values():
            short[job.workload.queue_id] += 1
        for wl in sc.workloads:
            if wl.mean_interarrival is None:
                for _ in range(wl.backlog - short[wl.queue_id]):
                    self.submit(wl)

    def admit(self, a: admission.Admission) -> None:
        sc = self.sc
        job = self.waiting.get(a.allocation_id)
        host = self.hosts.get(a.host_id)
        problem = None
        if job is None:
            problem = "not waiting"
        elif host is None or host.status != HostStatus.ready:
            problem = "no ready host"
        elif not a.gpu_indices or set(a.gpu_indices) & host.used or not set(a.gpu_indices) <= set(host.gpus):
            problem = f"GPUs {a.gpu_indices} not free on {host.name}"
        elif job.waiting.host_class and host.host_class != job.waiting.host_class:
            problem = "wrong host class"
        elif job.waiting.shape is CapacityShape.gpu_slice and len(a.gpu_indices) != job.waiting.count:
            problem = "wrong GPU count"
        elif job.waiting.shape is CapacityShape.baremetal and (host.used or len(a.gpu_indices) != len(host.gpus)):
            problem = "not a whole host"
        if problem is not None or job is None or host is None:
            self.fig.violations.append(f"t={self.now:.0f} admission {a.allocation_id}: {problem}")
            return
        del self.waiting[a.allocation_id]
        self.drop_reservations(a.allocation_id)
        self.reserved_for.pop(a.allocation_id, None)  # a requeued victim running again
        host.used |= set(a.gpu_indices)
        w = job.waiting
        self.count(w.queue_id, len(a.gpu_indices))
        for q in (w.queue_id, self.tenant_of[w.queue_id]):
            limit = sc.queues[q].limit if q in sc.queues else None
            if limit is not None and self.held[q] > limit:
                self.fig.violations.append(f"t={self.now:.0f} {q} holds {self.held[q]} > limit {limit}")
        running = Running(
            a.allocation_id,
            w.queue_id,
            len(a.gpu_indices),
            w.priority,
            self.now,
            host_id=a.host_id,
            tenant_id=w.tenant_id,
        )
        end_at = self.now + job.lifetime
        self.running[a.allocation_id] = _Run(job, running, a.host_id, a.gpu_indices, end_at)
        self.at(end_at, "end", a.allocation_id)
        self.fig.admissions += 1
        self.fig.waits.append(self.now - job.queued_at)
        self.fig.waits_by_queue.setdefault(w.queue_id, []).append(self.now - job.queued_at)

    def verify_accounting(self, result: admission.Plan) -> None:
        seen = [a.allocation_id for a in result.admissions] + [p.allocation_id for p in result.pending]
        if len(seen) != len(set(seen)) or set(seen) != set(self.waiting):
            lost = set(self.waiting) - set(seen)
            self.fig.violations.append(f"t={self.now:.0f} waiting requests lost or doubled: {len(lost)} lost")
        positions: dict[str, list[int]] = defaultdict(list)
        for p in result.pending:
            job = self.waiting.get(p.allocation_id)
            if job is not None:
                positions[job.waiting.queue_id].append(p.position)
            if p.reason not in set(PendingReason):
                self.fig.violations.append(f"t={self.now:.0f} unknown reason {p.reason}")
        for q, got in positions.items():
            if sorted(got) != list(range(1, len(got) + 1)):
                self.fig.violations.append(f"t={self.now:.0f} positions of {q} are not 1..n")
        used: set[tuple[uuid.UUID, int]] = set()
        for r in self.running.values():
            for g in r.gpus:
                if (r.host_id, g) in used:
                    self.fig.violations.append(f"t={self.now:.0f} GPU {g} of {r.host_id} held twice")
                used.add((r.host_id, g))


def percentile(values: list[float], p: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]
