"""Admission for one GPU pool (issue 29): who runs next when the fleet is full, and where.

Pure: no I/O. The caller (the service's admission loop, or the simulator in bench/capacity.py) passes the
pool's queues, running allocations, waiting requests and host capacity; `plan` answers which requests to
admit (each with a concrete placement), which allocations to preempt and why every other request waits.

Rules, in order of precedence:
- a ready beneficiary (a waiting request whose reserved victims have all stopped) goes first: the GPUs
  freed by a preemption go to the request they were freed for, not to whoever asks first;
- guarantees: a request that keeps its tenant within the tenant's guarantee, then one that keeps its
  project within the project's, before any borrowing;
- weighted fair share: among tenants, then among the projects of a tenant, the lowest weighted surplus
  after admission `(usage + asked - guarantee) / weight` (usage: GPUs held, plus decayed past usage in
  GPU-equivalents when a half-life is set);
- inside a project: priority (higher first), then age.
A request that cannot be admitted (limit, capacity) does not block the ones behind it. With no guarantee
and no weight set anywhere the order is plain first-come-first-served by (priority, age).
"""

from __future__ import annotations

import heapq
import math
import uuid
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from gpuaas.allocations.domain import HostCapacity, pick_gpus
from gpuaas.contracts.enums import CapacityShape, PendingReason
from gpuaas.contracts.events.allocations import HostStatus

_INF = math.inf
VICTIM_HOSTS_EXAMINED = 32  # hosts that can make room compared per preempting request (best of them wins)


@dataclass(frozen=True)
class QueueSettings:
    """One queue of the tree platform -> tenant -> project, for one pool (GPU model)."""

    queue_id: str  # "tenant:<uuid>" or "project:<uuid>"
    parent: str | None  # a project's tenant queue id; None for a tenant queue
    guarantee: int = 0
    limit: int | None = None  # most it may hold, borrowing included (None: no limit)
    lend_limit: int | None = None  # most of its unused guarantee others may borrow (None: all of it)
    weight: float = 1.0


@dataclass(frozen=True)
class Running:
    allocation_id: uuid.UUID
    queue_id: str  # its project queue
    gpus: int
    priority: int
    started_at: float
    preemptible: bool = True
    # Optional: where it runs (without it the allocation is never a victim: gang preemption needs the host)
    # and its tenant (without it, taken from the project's settings or from a waiting request of the project).
    host_id: uuid.UUID | None = None
    tenant_id: uuid.UUID | None = None


@dataclass(frozen=True)
class Waiting:
    allocation_id: uuid.UUID
    queue_id: str  # its project queue
    tenant_id: uuid.UUID
    shape: CapacityShape
    count: int  # GPUs asked (baremetal: the placement decides the count)
    host_class: str | None
    priority: int
    enqueued_at: float
    # A resize up of a running allocation: its extra GPUs (`count`) can only come from this host (gang rule:
    # one allocation's GPUs are on one host). Never preempts for (victims are chosen per host elsewhere).
    host_id: uuid.UUID | None = None


@dataclass(frozen=True)
class AdmissionConfig:
    min_runtime: float = 600.0
    usage_half_life: float | None = None
    preemption: bool = True


@dataclass(frozen=True)
class Admission:
    allocation_id: uuid.UUID
    host_id: uuid.UUID
    gpu_indices: tuple[int, ...]


@dataclass(frozen=True)
class Preemption:
    victim_id: uuid.UUID
    for_allocation_id: uuid.UUID
    reason: str


@dataclass(frozen=True)
class Pending:
    allocation_id: uuid.UUID
    reason: str
    position: int  # 1-based, in its project queue (priority then age)


@dataclass(frozen=True)
class Plan:
    admissions: tuple[Admission, ...]
    preemptions: tuple[Preemption, ...]
    pending: tuple[Pending, ...]


# ------------------------------------------------------------------------------------------ decayed usage


def decay(usage: float, elapsed: float, half_life: float) -> float:
    """Usage (GPU-seconds) `elapsed` seconds later, halving every `half_life` seconds."""
    if elapsed <= 0:
        return usage
    return usage * 0.5 ** (elapsed / half_life)


def accrue(usage: float, gpus: float, elapsed: float, half_life: float) -> float:
    """Decayed usage after holding `gpus` GPUs for `elapsed` more seconds (the exact integral, so the result
    does not depend on how often it is updated)."""
    if elapsed <= 0:
        return usage
    tau = half_life / math.log(2)
    return decay(usage, elapsed, half_life) + gpus * tau * (1 - 0.5 ** (elapsed / half_life))


def usage_equivalent(decayed: float, half_life: float) -> float:
    """Decayed GPU-seconds as GPUs: holding G GPUs for ever accrues G x half_life / ln 2."""
    return decayed * math.log(2) / half_life


def share(usage: float, asked: float, guarantee: int, weight: float) -> float:
    """A queue's weighted surplus after admitting `asked`: what fair sharing compares among siblings."""
    return max(0.0, usage + asked - guarantee) / max(weight, 1e-9)


# ------------------------------------------------------------------------------------------ free capacity


class _Capacity:
    """The pool's free GPUs, indexed by (host class, free count) so that best fit costs O(GPUs per host),
    not O(hosts); admissions inside one plan consume it. Same order as domain.candidates: fewest free GPUs
    left over, then host name."""

    def __init__(self, hosts: Iterable[HostCapacity], model: str) -> None:
        self.model = model
        self.hosts: dict[uuid.UUID, HostCapacity] = {}
        self.free_of: dict[uuid.UUID, int] = {}
        self.buckets: dict[tuple[str | None, int], list[tuple[str, uuid.UUID]]] = defaultdict(list)
        self.whole: dict[str | None, list[tuple[int, str, uuid.UUID]]] = defaultdict(list)
        self.free_by_class: dict[str | None, int] = defaultdict(int)
        self.free_total = 0
        self.max_size = 0
        for h in hosts:
            size = len(h.gpu_indices_by_model.get(model, ()))
            if h.status != HostStatus.ready or size == 0:
                continue
            self.hosts[h.host_id] = h
            self.max_size = max(self.max_size, size)
            self._index(h)
        for heap in self.buckets.values():
            heapq.heapify(heap)
        for heap in self.whole.values():
            heapq.heapify(heap)
        self.classes = sorted(self.free_by_class, key=lambda c: (c is not None, c or ""))

    def _index(self, h: HostCapacity) -> None:
        k = len(h.free(self.model))
        self.free_of[h.host_id] = k
        self.free_by_class[h.host_class] += k
        self.free_total += k
        if k:
            self.buckets[(h.host_class, k)].append((h.name, h.host_id))
        if self._is_whole(h):
            self.whole[h.host_class].append((k, h.name, h.host_id))

    def _is_whole(self, h: HostCapacity) -> bool:
        model_gpus = h.gpu_indices_by_model.get(self.model, [])
        return not h.used and bool(model_gpus) and h.total == len(model_gpus)

    def free_for(self, host_class: str | None) -> int:
        return self.free_total if host_class is None else self.free_by_class.get(host_class, 0)

    def best(self, shape: CapacityShape, count: int, host_class: str | None) -> HostCapacity | None:
        classes = self.classes if host_class is None else [host_class]
        if shape is CapacityShape.baremetal:
            found: tuple[int, str, uuid.UUID] | None = None
            for c in classes:
                heap = self.whole.get(c)
                while heap and not self._is_whole(self.hosts[heap[0][2]]):
                    heapq.heappop(heap)  # no longer whole: taken earlier in this plan
                if heap and (found is None or heap[0] < found):
                    found = heap[0]
            return self.hosts[found[2]] if found else None
        if self.free_for(host_class) < count:
            return None
        for k in range(count, self.max_size + 1):
            top: tuple[str, uuid.UUID] | None = None
            for c in classes:
                heap = self.buckets.get((c, k))
                while heap and self.free_of[heap[0][1]] != k:
                    heapq.heappop(heap)  # stale: the host has fewer free GPUs now
                if heap and (top is None or heap[0] < top):
                    top = heap[0]
            if top is not None:
                return self.hosts[top[1]]
        return None

    def take(self, host: HostCapacity, gpus: Sequence[int]) -> None:
        updated = replace(host, used=host.used | frozenset(gpus))
        self.hosts[host.host_id] = updated
        k_old = self.free_of[host.host_id]
        k = len(updated.free(self.model))
        self.free_of[host.host_id] = k
        self.free_by_class[host.host_class] -= k_old - k
        self.free_total -= k_old - k
        if k:
            heapq.heappush(self.buckets[(host.host_class, k)], (host.name, host.host_id))


# ------------------------------------------------------------------------------------------------ queues


@dataclass
class _Queue:
    guarantee: int = 0
    limit: float = _INF
    lend_limit: float = _INF
    weight: float = 1.0
    held: int = 0
    past: float = 0.0  # decayed past usage in GPU-equivalents
    promised: int = 0  # GPUs being freed for its requests by preemption (counts toward its guarantee)
    after_victims: int = 0  # held minus the GPUs of victims chosen so far (never below the guarantee)

    def reserved(self) -> int:
        """Its unused guarantee that others may not borrow (beyond its lend_limit)."""
        unused = max(0, self.guarantee - self.held)
        return int(max(0.0, unused - self.lend_limit))


def _settings(q: _Queue, s: QueueSettings | None) -> _Queue:
    if s is not None:
        q.guarantee = max(0, s.guarantee)
        q.limit = _INF if s.limit is None else s.limit
        q.lend_limit = _INF if s.lend_limit is None else s.lend_limit
        q.weight = s.weight
    return q


@dataclass
class _Project:
    queue: _Queue
    tenant: str
    waiting: list[Waiting] = field(default_factory=list)
    head: int = 0  # index of the next request to consider


_Victim = tuple[Running, _Project, _Queue]  # a running allocation, its project and its tenant
_VictimHost = tuple[uuid.UUID, HostCapacity, list[_Victim], int]  # host id, host, victims, their GPUs


def _order(w: Waiting) -> tuple[int, float, int]:
    return (-w.priority, w.enqueued_at, w.allocation_id.int)


# ---------------------------------------------------------------------------------------------- the plan


def plan(
    *,
    model: str,
    queues: Mapping[str, QueueSettings],
    running: Sequence[Running],
    waiting: Sequence[Waiting],
    hosts: Sequence[HostCapacity],
    now: float,
    decayed_usage: Mapping[str, float] | None = None,
    reserved_for: Mapping[uuid.UUID, uuid.UUID] | None = None,
    config: AdmissionConfig = AdmissionConfig(),
) -> Plan:
    return _Planner(
        model=model,
        queues=queues,
        running=running,
        waiting=waiting,
        hosts=hosts,
        now=now,
        decayed_usage=decayed_usage or {},
        reserved_for=reserved_for or {},
        config=config,
    ).run()


class _Planner:
    def __init__(
        self,
        *,
        model: str,
        queues: Mapping[str, QueueSettings],
        running: Sequence[Running],
        waiting: Sequence[Waiting],
        hosts: Sequence[HostCapacity],
        now: float,
        decayed_usage: Mapping[str, float],
        reserved_for: Mapping[uuid.UUID, uuid.UUID],
        config: AdmissionConfig,
    ) -> None:
        self.model, self.now, self.config = model, now, config
        self.running, self.reserved_for = running, reserved_for
        self.cap = _Capacity(hosts, model)
        # No guarantee, no weight and no usage history set: today's first-come-first-served (with waiting).
        self.fcfs = not config.usage_half_life and not any(s.guarantee > 0 or s.weight != 1.0 for s in queues.values())
        self.tenants: dict[str, _Queue] = {}
        self.projects: dict[str, _Project] = {}
        # Keyed by id(w): each Waiting is one request, and int keys hash far faster than UUIDs at 10k.
        self.reason: dict[int, PendingReason] = {}
        self.admissions: list[Admission] = []
        self.preemptions: list[Preemption] = []
        self.admitted: set[int] = set()

        tenant_of_project: dict[str, str] = {}
        for w in waiting:
            if w.queue_id not in tenant_of_project:
                tenant_of_project[w.queue_id] = f"tenant:{w.tenant_id}"
        for r in running:
            if r.tenant_id is not None and r.queue_id not in tenant_of_project:
                tenant_of_project[r.queue_id] = f"tenant:{r.tenant_id}"
        for s in queues.values():
            if s.parent is not None:
                tenant_of_project[s.queue_id] = s.parent  # settings win

        def project(pid: str) -> _Project:
            p = self.projects.get(pid)
            if p is None:
                tid = tenant_of_project.get(pid, f"tenant:?{pid}")
                if tid not in self.tenants:
                    self.tenants[tid] = _settings(_Queue(), queues.get(tid))
                p = self.projects[pid] = _Project(_settings(_Queue(), queues.get(pid)), tid)
            return p

        for s in queues.values():  # an idle queue still reserves its unlendable guarantee
            if s.parent is None:
                self.tenants.setdefault(s.queue_id, _settings(_Queue(), s))
            else:
                project(s.queue_id)
        for r in running:
            p = project(r.queue_id)
            p.queue.held += r.gpus
            self.tenants[p.tenant].held += r.gpus
        for w in waiting:
            project(w.queue_id).waiting.append(w)
        for p in self.projects.values():
            p.waiting.sort(key=_order)
            p.queue.after_victims = p.queue.held
        for t in self.tenants.values():
            t.after_victims = t.held

        if config.usage_half_life and decayed_usage:
            hl = config.usage_half_life
            tenant_past: dict[str, float] = defaultdict(float)
            for qid, used in decayed_usage.items():
                if qid in self.projects:
                    self.projects[qid].queue.past = usage_equivalent(used, hl)
                    tenant_past[self.projects[qid].tenant] += usage_equivalent(used, hl)
            for tid, t in self.tenants.items():
                t.past = usage_equivalent(decayed_usage[tid], hl) if tid in decayed_usage else tenant_past[tid]

        self.waiting_by_id: dict[uuid.UUID, Waiting] = {}
        self.held_back: set[uuid.UUID] = set()
        self.victims_left: dict[uuid.UUID, int] = defaultdict(int)
        self.promised_of: dict[uuid.UUID, int] = {}
        if reserved_for:
            self.under_way(waiting)
        self.reserved_total = sum(t.reserved() for t in self.tenants.values())
        self.reserved_in: dict[str, int] = defaultdict(int)  # tenant -> sum of its projects' reserved
        for p in self.projects.values():
            self.reserved_in[p.tenant] += p.queue.reserved()
        self.preempt_failed: dict[tuple[object, ...], int] = {}
        self.taken_victims: set[int] = set()  # id() of the Running objects chosen in this plan
        self._victims: list[_VictimHost] | None = None
        self._held_on: dict[uuid.UUID, int] = defaultdict(int)
        self._lowest_priority = 1 << 62

    def under_way(self, waiting: Sequence[Waiting]) -> None:
        """Preemptions already under way: their victims are spoken for, their beneficiaries wait for them."""
        running_ids = {r.allocation_id for r in self.running}
        beneficiaries = set(self.reserved_for.values())
        self.waiting_by_id = {w.allocation_id: w for w in waiting if w.allocation_id in beneficiaries}
        for victim, beneficiary in self.reserved_for.items():
            if beneficiary in self.waiting_by_id:
                self.victims_left[beneficiary] += victim in running_ids
        for beneficiary in self.victims_left:
            self.promise(self.waiting_by_id[beneficiary], +1)
        # What its stopped victims already freed is held back for a beneficiary until the last one stops
        # (its victims share one host), so that nobody else takes the GPUs in between.
        for r in self.running:
            beneficiary, host_id = self.reserved_for.get(r.allocation_id), r.host_id
            if beneficiary is None or beneficiary not in self.victims_left or host_id is None:
                continue
            if host_id in self.cap.hosts and host_id not in self.held_back:
                host = self.cap.hosts[host_id]
                free = sorted(host.free(self.model))[: self.asked(self.waiting_by_id[beneficiary])]
                self.held_back.add(host_id)
                if free:
                    self.cap.take(host, free)

    def promise(self, w: Waiting, sign: int) -> None:
        """Count (+1) or uncount (-1) the GPUs being freed for `w` toward its queues' guarantees."""
        n = self.promised_of.pop(w.allocation_id, 0) if sign < 0 else self.asked(w)
        if sign > 0:
            self.promised_of[w.allocation_id] = n
        p = self.projects[w.queue_id]
        p.queue.promised += sign * n
        self.tenants[p.tenant].promised += sign * n

    # -------------------------------------------------------------------------------------- the loop

    def run(self) -> Plan:
        # Beneficiaries whose victims have all stopped take the GPUs freed for them first.
        ready = [self.waiting_by_id[b] for b, left in self.victims_left.items() if left == 0]
        for w in sorted(ready, key=_order):
            self.consider(w, preempt=False)
        if self.fcfs:
            for w in sorted((w for p in self.projects.values() for w in p.waiting), key=_order):
                if self.cap.free_total == 0:
                    break  # the rest get their reason when the result is built
                if id(w) not in self.admitted:
                    self.consider(w, preempt=False)
        else:
            self.fair_loop()
        return self.result()

    def fair_loop(self) -> None:
        by_tenant: dict[str, list[tuple[tuple[object, ...], str]]] = defaultdict(list)
        for pid, p in self.projects.items():
            key = self.project_key(p)
            if key is not None:
                by_tenant[p.tenant].append((key, pid))
        for heap in by_tenant.values():
            heapq.heapify(heap)
        top: list[tuple[tuple[object, ...], str]] = []
        for tid, heap in by_tenant.items():
            top.append((self.tenant_key(tid, heap[0][1]), tid))
        heapq.heapify(top)
        while top and self.cap.free_total > 0:
            _, tid = heapq.heappop(top)
            heap = by_tenant[tid]
            _, pid = heapq.heappop(heap)
            p = self.projects[pid]
            w = p.waiting[p.head]
            p.head += 1
            if id(w) not in self.admitted:
                self.consider(w, preempt=True)
            key = self.project_key(p)
            if key is not None:
                heapq.heappush(heap, (key, pid))
            if heap:
                # Admitting changed this tenant's share only: the other tenants' keys stay valid. The
                # project keys of the tenant's other projects depend on their own usage only.
                heapq.heappush(top, (self.tenant_key(tid, heap[0][1]), tid))

        # The pool is full: nothing more can be placed, so what is left only needs its reason, and the
        # requests within a guarantee may still preempt (in priority-then-age order; cheap when none can).
        rest = [w for _, tid in top for w in self.left_in(tid, by_tenant)]
        if self.config.preemption:
            guaranteed = [w for w in rest if self.within_guarantee(w, self.projects[w.queue_id])]
            for w in sorted(guaranteed, key=_order):
                self.consider(w, preempt=True)
        # The others get their reason when the result is built.

    def left_in(self, tid: str, by_tenant: Mapping[str, list[tuple[tuple[object, ...], str]]]) -> Iterable[Waiting]:
        for _, pid in by_tenant[tid]:
            p = self.projects[pid]
            yield from (w for w in p.waiting[p.head :] if id(w) not in self.admitted)

    def within_guarantee(self, w: Waiting, p: _Project) -> bool:
        t, q, n = self.tenants[p.tenant], p.queue, self.asked(w)
        return (t.guarantee > 0 and t.held + t.promised + n <= t.guarantee) or (
            q.guarantee > 0 and q.held + q.promised + n <= q.guarantee
        )

    def asked(self, w: Waiting) -> int:
        return self.cap.max_size if w.shape is CapacityShape.baremetal else w.count

    def project_key(self, p: _Project) -> tuple[object, ...] | None:
        while p.head < len(p.waiting) and id(p.waiting[p.head]) in self.admitted:
            p.head += 1
        if p.head >= len(p.waiting):
            return None
        w, q = p.waiting[p.head], p.queue
        n = self.asked(w)
        guaranteed = q.guarantee > 0 and q.held + q.promised + n <= q.guarantee
        return (not guaranteed, share(q.held + q.past, n, q.guarantee, q.weight), *_order(w))

    def tenant_key(self, tid: str, pid: str) -> tuple[object, ...]:
        p = self.projects[pid]
        w, t = p.waiting[p.head], self.tenants[tid]
        n = self.asked(w)
        guaranteed = t.guarantee > 0 and t.held + t.promised + n <= t.guarantee
        return (not guaranteed, share(t.held + t.past, n, t.guarantee, t.weight), *_order(w))

    # ------------------------------------------------------------------------------ one request

    def blocked_reason(self, w: Waiting, p: _Project) -> PendingReason:
        t, n = self.tenants[p.tenant], self.asked(w)
        if p.queue.held + n > p.queue.limit:
            return PendingReason.over_limit
        if t.held + n > t.limit:
            return PendingReason.over_tenant_limit
        if self.victims_left and self.victims_left.get(w.allocation_id):
            return PendingReason.waiting_for_preemption
        return PendingReason.no_capacity

    def consider(self, w: Waiting, *, preempt: bool) -> None:
        p = self.projects[w.queue_id]
        t = self.tenants[p.tenant]
        q = p.queue
        n = w.count
        host: HostCapacity | None = None
        if w.shape is CapacityShape.baremetal:
            host = self.cap.best(w.shape, n, w.host_class)
            n = len(host.gpu_indices_by_model[self.model]) if host else self.cap.max_size
        if q.held + n > q.limit:
            self.reason[id(w)] = PendingReason.over_limit
            return
        if t.held + n > t.limit:
            self.reason[id(w)] = PendingReason.over_tenant_limit
            return
        # Borrowing beyond its own guarantee must leave others' unlendable unused guarantee free.
        keep = 0
        if t.held + n > t.guarantee:
            keep += self.reserved_total - t.reserved()
        if q.held + n > q.guarantee:
            keep += self.reserved_in[p.tenant] - q.reserved()
        if w.host_id is not None:  # a resize: its own host or nothing
            pinned = self.cap.hosts.get(w.host_id)
            fits = pinned is not None and self.cap.free_of[w.host_id] >= n and self.cap.free_total - n >= keep
            host = pinned if fits else None
        elif w.shape is not CapacityShape.baremetal:
            host = self.cap.best(w.shape, n, w.host_class) if self.cap.free_total - n >= keep else None
        elif host is not None and self.cap.free_total - n < keep:
            host = None
        gpus = pick_gpus(host, shape=w.shape, model=self.model, count=n) if host else None
        if host is None or gpus is None:
            reason = self.blocked_reason(w, p)
            if preempt and reason is PendingReason.no_capacity and self.plan_preemption(w, p):
                reason = PendingReason.waiting_for_preemption
            self.reason[id(w)] = reason
            return
        self.cap.take(host, gpus)
        self.admissions.append(Admission(w.allocation_id, host.host_id, tuple(gpus)))
        self.admitted.add(id(w))
        self.reason.pop(id(w), None)
        self.reserved_total -= t.reserved()
        self.reserved_in[p.tenant] -= q.reserved()
        for queue in (q, t):
            queue.held += len(gpus)
            queue.after_victims += len(gpus)
        if self.promised_of and w.allocation_id in self.promised_of:
            self.promise(w, -1)
        self.reserved_total += t.reserved()
        self.reserved_in[p.tenant] += q.reserved()

    # -------------------------------------------------------------------------------- preemption

    def plan_preemption(self, w: Waiting, p: _Project) -> bool:
        """Free enough GPUs on ONE host for `w` by preempting allocations over their queue's guarantee."""
        if not self.config.preemption or w.host_id is not None or self.victims_left.get(w.allocation_id):
            return False  # its victims are still stopping
        t, q, n = self.tenants[p.tenant], p.queue, self.asked(w)
        by_tenant = t.guarantee > 0 and t.held + t.promised + n <= t.guarantee
        by_project = q.guarantee > 0 and q.held + q.promised + n <= q.guarantee
        if not (by_tenant or by_project):
            return False
        key = (p.tenant, w.queue_id if by_project else None, by_tenant, w.shape, w.host_class)
        if n >= self.preempt_failed.get(key, 1 << 30):
            return False  # a smaller request of the same kind found no victims already
        chosen = self.find_victims(w, p, n, by_tenant=by_tenant, by_project=by_project)
        if chosen is None:
            self.preempt_failed[key] = min(n, self.preempt_failed.get(key, 1 << 30))
            return False
        for r in chosen:
            self.preemptions.append(Preemption(r.allocation_id, w.allocation_id, "reclaim_guarantee"))
            self.taken_victims.add(id(r))
            vp = self.projects[r.queue_id]
            vp.queue.after_victims -= r.gpus
            self.tenants[vp.tenant].after_victims -= r.gpus
        self.victims_left[w.allocation_id] = len(chosen)
        if w.allocation_id not in self.promised_of:
            self.promise(w, +1)
        return True

    def victims_by_host(self) -> list[_VictimHost]:
        """Allocations that may be preempted at all, by host, best victim first (built on first use); hosts
        whose best victims have the lowest priority first, since find_victims compares a bounded number."""
        if self._victims is None:
            by_host: dict[uuid.UUID, list[_Victim]] = defaultdict(list)
            for r in self.running:
                if r.host_id is None:
                    continue
                self._held_on[r.host_id] += r.gpus
                if (
                    r.preemptible
                    and r.host_id in self.cap.hosts
                    and not (self.reserved_for and r.allocation_id in self.reserved_for)
                    and self.now - r.started_at >= self.config.min_runtime
                ):
                    vp = self.projects[r.queue_id]
                    by_host[r.host_id].append((r, vp, self.tenants[vp.tenant]))
            hosts: list[_VictimHost] = []
            for host_id, victims in by_host.items():
                # lowest priority, youngest first, then fewest GPU-seconds lost
                victims.sort(key=lambda v: (v[0].priority, -v[0].started_at, v[0].gpus * (self.now - v[0].started_at)))
                hosts.append((host_id, self.cap.hosts[host_id], victims, sum(v[0].gpus for v in victims)))
                self._lowest_priority = min(self._lowest_priority, victims[0][0].priority)
            hosts.sort(key=lambda h: (h[2][0][0].priority, h[1].name))
            self._victims = hosts
        return self._victims

    def find_victims(
        self, w: Waiting, p: _Project, n: int, *, by_tenant: bool, by_project: bool
    ) -> list[Running] | None:
        own = self.tenants[p.tenant]
        whole = w.shape is CapacityShape.baremetal
        best: tuple[tuple[object, ...], list[Running]] | None = None
        looked = 0
        free_of, taken = self.cap.free_of, self.taken_victims
        for host_id, host, victims, victim_gpus in self.victims_by_host():
            if looked >= VICTIM_HOSTS_EXAMINED:
                break  # bounded work per request at fleet scale; hosts with the cheapest victims came first
            if w.host_class and host.host_class != w.host_class:
                continue
            if whole and host.total != len(host.gpu_indices_by_model[self.model]):
                continue
            need = host.total if whole else n
            free = start = free_of[host_id]
            if free + victim_gpus < need:
                continue  # even every victim there would not make room
            chosen: list[Running] = []
            drop: dict[int, int] = defaultdict(int)  # id(queue) -> GPUs taken from it on this host
            for r, vp, vt in victims:
                if free >= need and not whole:
                    break
                if id(r) in taken:
                    continue
                if by_tenant and vt is not own and self._over(vt, r.gpus, drop):
                    drop[id(vt)] += r.gpus
                elif by_project and vt is own and vp is not p and self._over(vp.queue, r.gpus, drop):
                    drop[id(vp.queue)] += r.gpus
                else:
                    continue
                chosen.append(r)
                free += r.gpus
            if whole and sum(r.gpus for r in chosen) < self._held_on[host_id]:
                continue  # a whole host needs every allocation on it gone
            if free < need or not chosen:
                continue
            looked += 1
            gpus = sum(r.gpus for r in chosen)
            lost = sum(r.gpus * (self.now - r.started_at) for r in chosen)
            cost = (max(r.priority for r in chosen), gpus, lost, host.name)
            if best is None or cost < best[0]:
                best = (cost, chosen)
            if cost[0] == self._lowest_priority and gpus == need - start:
                break  # lowest-priority victims and no GPU preempted in vain: no host can do better
        return best[1] if best else None

    @staticmethod
    def _over(queue: _Queue, gpus: int, drop: Mapping[int, int]) -> bool:
        """Preempting `gpus` more leaves the queue at or above its guarantee: never work inside it."""
        return queue.after_victims - drop.get(id(queue), 0) - gpus >= queue.guarantee

    # ------------------------------------------------------------------------------------ result

    def result(self) -> Plan:
        pending: list[Pending] = []
        for p in self.projects.values():
            position = 0
            for w in p.waiting:
                if id(w) in self.admitted:
                    continue
                position += 1
                reason = self.reason.get(id(w)) or self.blocked_reason(w, p)
                pending.append(Pending(w.allocation_id, reason, position))  # a StrEnum is its value
        return Plan(tuple(self.admissions), tuple(self.preemptions), tuple(pending))
