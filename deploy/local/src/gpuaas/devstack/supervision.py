"""Keeping a running stack whole: restart what died, and survive the loss of the embedded broker.

Tansu keeps everything in memory: when it is restarted (or dies and supervision restarts it) every
service is restarted, so that its producer and consumer talk to the new broker, and
`python -m gpuaas.<service> replay --since <the lost broker's start time>` requeues what had been
published to the lost broker (consumers dedupe by event id). Apache Kafka keeps its log: it is only
stopped and started again, and the services ride it out.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from gpuaas.devstack.agents import LocalAgents
from gpuaas.devstack.config import StackError, StackInterrupted
from gpuaas.devstack.containers import ContainerKafka
from gpuaas.devstack.infra import EmbeddedPostgres, Tansu, reap_group
from gpuaas.devstack.kafka import ApacheKafka
from gpuaas.devstack.processes import Lifecycle, ServiceProcess, ServiceProcesses, run_coro

log = logging.getLogger("gpuaas.devstack")
# Replay a little before the lost broker's start: the database clock (outbox created_at) and ours
# may differ when the database is external. Replaying too much is harmless (consumers dedupe).
REPLAY_MARGIN_S = 30.0
# A service that stayed up this long is healthy again: its restart backoff starts over.
HEALTHY_UPTIME_S = 60.0
MAX_BACKOFF_S = 30.0


class OutboxReplay:
    """`replay --since` for each service that published anything to a lost broker."""

    def __init__(
        self,
        processes: ServiceProcesses,
        services: list[str],
        fetchval: Callable[..., Awaitable[Any]],  # (service, sql, *args) as the service's own role
    ) -> None:
        self.processes = processes
        self.services = services
        self.fetchval = fetchval
        self.last: list[str] = []  # services whose outbox the last replay requeued

    def replay(self, since_epoch: float) -> list[str]:
        """Services with nothing to requeue are skipped (a quick query as their role), which saves a
        process start each. Returns the services replayed."""
        since = datetime.fromtimestamp(since_epoch - REPLAY_MARGIN_S, UTC)
        names = run_coro(lambda: self._published_since(since))
        self.last = names
        if names:
            self.processes.run_all("replay", ["--since", since.isoformat()], names=names)
        else:
            log.info("replay: no service published anything since %s", since.isoformat())
        return names

    async def _published_since(self, since: datetime) -> list[str]:
        sql = "SELECT EXISTS (SELECT 1 FROM outbox WHERE created_at >= $1 AND sent_at IS NOT NULL)"
        names = []
        for svc in self.services:
            try:
                if await self.fetchval(svc, sql, since):
                    names.append(svc)
            except Exception as exc:  # cannot tell: let the service's own replay decide
                log.warning("replay check for %s failed (%s); replaying it anyway", svc, exc)
                names.append(svc)
        return names


class Supervisor:
    """Restarts the embedded servers and the services that died; owns the broker's restarts."""

    def __init__(
        self,
        lifecycle: Lifecycle,
        processes: ServiceProcesses,
        services: list[str],
        pg: EmbeddedPostgres | None,
        tansu: Tansu | None,
        kafka: ApacheKafka | ContainerKafka | None,
        agents: LocalAgents,
        outbox: OutboxReplay,
        on_change: Callable[[], None],  # rewrite stack.json
        ready_timeout_s: float,
    ) -> None:
        self.lifecycle = lifecycle
        self.processes = processes
        self.services = services
        self.pg, self.tansu, self.kafka = pg, tansu, kafka
        self.agents = agents
        self.outbox = outbox
        self.on_change = on_change
        self.ready_timeout_s = ready_timeout_s
        self.broker_down = False  # stop_broker() was called: supervision leaves the broker down
        # Outbox rows created since then may sit only on the current (memory-only) broker: what the next
        # start or broker restart replays. Set once services have run against the broker.
        self.replay_from: float | None = None

    def _wait_ready(self, names: list[str] | None, timeout: float | None) -> None:
        self.processes.wait_ready(names, self.ready_timeout_s if timeout is None else timeout)

    # ------------------------------------------------------------------------------------- broker

    def restart_broker(self, wait: bool = True, timeout: float | None = None) -> None:
        """Tansu: fresh embedded broker on the same port; restart every service; replay the lost broker's
        log. Apache Kafka: stop and start the broker keeping its log; the services stay up and reconnect."""
        if self.kafka is not None:
            self.stop_broker()
            self.start_broker()
            if wait:
                self._wait_ready(None, timeout)
            return
        if self.tansu is None:
            raise StackError("the broker is external (GPUAAS_KAFKA_BOOTSTRAP): the stack never restarts it")
        with self.lifecycle.lock:
            self.lifecycle.require_started()
            lost_since = self.tansu.started_at
            names = [n for n in self.services if self.processes.get(n).wanted or self.processes.get(n).running]
            # Services first, while the broker (if alive) still answers their clean shutdown; with a dead
            # broker their consumers cannot leave cleanly, so do not wait long.
            self.processes.stop(names, timeout_s=15.0 if self.tansu.running else 8.0)
            self.tansu.stop()
            self.tansu.start()
            log.warning("broker restarted (fresh, empty) on %s", self.tansu.bootstrap)
            self.outbox.replay(min(lost_since, self.replay_from or lost_since))
            for n in names:
                self.processes.spawn(n)
            self.replay_from = self.tansu.started_at
            self.on_change()
        if wait:
            self._wait_ready(names, timeout)

    def stop_broker(self, sig: int = signal.SIGTERM) -> None:
        """Apache Kafka only: stop the broker (SIGTERM: controlled shutdown; SIGKILL: crash) and leave it
        down until start_broker(); the services keep running and must ride it out."""
        if self.kafka is None:
            raise StackError("stop_broker() needs the stack's own Apache Kafka (broker='kafka')")
        with self.lifecycle.lock:
            self.lifecycle.require_started()
            self.broker_down = True
            self.kafka.stop(sig)
            log.warning("Apache Kafka stopped (%s); its log is kept", signal.Signals(sig).name)
            self.on_change()

    def start_broker(self) -> None:
        """Apache Kafka only: start the stopped broker again on the same port with the same log."""
        if self.kafka is None:
            raise StackError("start_broker() needs the stack's own Apache Kafka (broker='kafka')")
        with self.lifecycle.lock:
            self.lifecycle.require_started()
            self.kafka.start()
            self.broker_down = False
            log.warning("Apache Kafka started again on %s", self.kafka.bootstrap)
            self.on_change()

    # ---------------------------------------------------------------------------------- supervision

    def supervise(self, stop: threading.Event | None = None, interval_s: float = 1.0) -> None:
        """Keep the stack up until `stop` (default: the stack's cancel flag) is set. Every action is logged."""
        stop = stop or self.lifecycle.cancel
        while not stop.is_set():
            try:
                self.supervise_once()
            except StackInterrupted:
                return
            except StackError as exc:
                log.error("supervision: %s", exc)
            stop.wait(interval_s)

    def supervise_once(self) -> list[str]:
        """One pass: a dead embedded broker gets the restart_broker() sequence, a dead embedded Postgres
        is restarted, a service that died unexpectedly is restarted with backoff. Returns what was
        restarted ("broker", "kafka", "postgres", service names, "agent-<name>")."""
        actions: list[str] = []
        with self.lifecycle.lock:
            if not self.lifecycle.started:
                return actions
            actions += self._restart_servers()
            now = time.monotonic()
            for sp in self.processes.all():
                if sp.wanted and not sp.running and self._restart_due(sp, now):
                    self.processes.spawn(sp.name)
                    sp.awaiting_ready = True
                    actions.append(sp.name)
            actions += self.agents.supervise()
            self.processes.log_ready_again()
            if actions:
                self.on_change()
        if "broker" in actions:
            self._wait_ready([n for n in self.services if self.processes.get(n).running], None)
            log.info("services ready again after the broker restart")
        return actions

    def _restart_servers(self) -> list[str]:
        actions = []
        if self.pg is not None and not self.pg.running:
            rc = self.pg.proc.returncode if self.pg.proc is not None else None
            reap_group(self.pg.proc)
            log.warning("Postgres exited (code %s); restarting it", rc)
            self.pg.start()
            actions.append("postgres")
        if self.tansu is not None and not self.tansu.running:
            rc = self.tansu.proc.returncode if self.tansu.proc is not None else None
            reap_group(self.tansu.proc)
            log.warning(
                "the broker exited (code %s): everything it held is lost; restarting it, restarting the "
                "services and replaying their outboxes",
                rc,
            )
            self.restart_broker(wait=False)
            actions.append("broker")
        if self.kafka is not None and not self.kafka.running and not self.broker_down:
            rc = self.kafka.proc.returncode if self.kafka.proc is not None else None
            reap_group(self.kafka.proc)
            log.warning("Apache Kafka exited (code %s); restarting it (its log is kept)", rc)
            self.kafka.start()
            actions.append("kafka")
        return actions

    def _restart_due(self, sp: ServiceProcess, now: float) -> bool:
        """Backoff for a service that died: 0 s, 1 s, 3 s, … up to MAX_BACKOFF_S; reset after a healthy run."""
        if sp.restart_due is None:
            reap_group(sp.proc)
            if now - sp.started_mono >= HEALTHY_UPTIME_S:
                sp.failures = 0
            delay = min(MAX_BACKOFF_S, float(2**sp.failures - 1))
            sp.failures += 1
            sp.restart_due = now + delay
            log.warning(
                "%s exited unexpectedly (code %s); restarting in %.0fs — see %s",
                sp.name,
                sp.proc.returncode if sp.proc is not None else None,
                delay,
                self.processes.log_path(sp.name),
            )
        return now >= sp.restart_due
