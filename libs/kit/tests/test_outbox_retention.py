"""Outbox retention and replay over a real time range, on the real Postgres and broker: the relay prunes
only published rows older than the retention, and `replay --since/--until` (the service command an operator
runs after a broker lost its log) republishes exactly the rows published in that range, which consumers
then drop as duplicates through their inbox."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import text

from gpuaas.contracts.registry import AUDIT
from gpuaas.kit.cli import main as service_command
from gpuaas.kit.db import create_engine, session_factory, to_plain_url
from gpuaas.kit.metrics import ServiceMetrics
from gpuaas.kit.outbox import add_events
from gpuaas.kit.relay import OutboxRelay
from gpuaas.kit.testing import build, new_service_db, running, spec, wait_for

from .test_outbox_inbox import audit_event, counting_handlers, fetch, make_applied_table

pytestmark = pytest.mark.integration


async def _set_times(url: str, schema: str, times: dict[int, tuple[datetime, datetime | None]]) -> None:
    """Give outbox rows (by seq) a creation and a publication time (None: not published)."""
    engine = create_engine(url, schema)
    async with engine.begin() as conn:
        for seq, (created, sent) in times.items():
            await conn.execute(
                text("UPDATE outbox SET created_at = :c, sent_at = :s WHERE seq = :q"),
                {"c": created, "s": sent, "q": seq},
            )
    await engine.dispose()


async def test_prune_drops_only_published_rows_older_than_the_retention(infra: Any) -> None:
    name, url = await new_service_db(infra.admin_url, "prune")
    engine = create_engine(url, name)
    sessions = session_factory(engine)
    run = uuid.uuid4().hex
    async with sessions() as s, s.begin():
        await add_events(s, [audit_event(run, f"agg-{i}", i) for i in range(6)])
    seqs = [seq for (seq,) in await fetch(url, name, "SELECT seq FROM outbox ORDER BY seq")]
    now = datetime.now(UTC)
    long_ago = now - timedelta(days=30)
    ages = {  # seq -> (created, published); the retention is 48 hours
        seqs[0]: (long_ago, now - timedelta(hours=200)),  # published long ago: pruned
        seqs[1]: (long_ago, now - timedelta(hours=49)),  # just beyond the retention: pruned
        seqs[2]: (long_ago, now - timedelta(hours=47)),  # created long ago, published inside it: kept
        seqs[3]: (now, now - timedelta(minutes=1)),  # fresh: kept
        seqs[4]: (long_ago, None),  # never published, however old: kept (it is still owed to the broker)
        seqs[5]: (now, None),
    }
    await _set_times(url, name, ages)
    none: Any = None  # prune never touches the broker
    relay = OutboxRelay(
        schema=name,
        engine=engine,
        sessions=sessions,
        producer=none,
        dsn=to_plain_url(url),
        metrics=ServiceMetrics("prune"),
        retention_hours=48,
    )
    try:
        assert await relay.prune() == 2
        left = [seq for (seq,) in await fetch(url, name, "SELECT seq FROM outbox ORDER BY seq")]
        assert left == seqs[2:]
        assert await relay.prune() == 0
    finally:
        await engine.dispose()


async def test_replay_of_a_since_until_range_republishes_only_that_range_and_consumers_dedupe(
    infra: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = uuid.uuid4().hex
    prod_name, prod_url = await new_service_db(infra.admin_url, "prod")
    cons_name, cons_url = await new_service_db(infra.admin_url, "cons")
    await make_applied_table(cons_url, cons_name)
    producer = build(
        prod_name, prod_url, infra.kafka_bootstrap, with_iam=False, settings={"outbox_retention_hours": 48}
    )
    consumer = build(cons_name, cons_url, infra.kafka_bootstrap, with_iam=False, subscriptions=counting_handlers(run))

    async def applied() -> list[tuple[str, int]]:
        return [(s, q) for s, q in await fetch(cons_url, cons_name, "SELECT subject, seq FROM applied ORDER BY n")]

    async def outbox_rows() -> dict[int, datetime | None]:
        return dict(await fetch(prod_url, prod_name, "SELECT seq, sent_at FROM outbox ORDER BY seq"))

    async with running(producer) as (_, pkit), running(consumer) as (_, ckit):
        assert pkit.relay is not None and pkit.relay.retention == timedelta(hours=48)  # the setting reaches it
        groups = {"before": 4, "inside": 5, "after": 3}
        for group, n in groups.items():
            async with pkit.sessions() as s, s.begin():
                await add_events(s, [audit_event(run, f"{group}-{i}", i) for i in range(n)])
        total = sum(groups.values())
        await wait_for(lambda: _has(applied(), total), 60, "every event applied once")
        await wait_for(lambda: _all_sent(outbox_rows()), 30, "every row published")

        # Spread the publication times over three hours: the range to replay is the middle hour.
        seqs = sorted(await outbox_rows())
        base = datetime.now(UTC).replace(microsecond=0)
        hours = {"before": 3, "inside": 2, "after": 1}
        times, by_group, i = {}, {}, 0
        for group, n in groups.items():
            by_group[group] = seqs[i : i + n]
            for k, seq in enumerate(by_group[group]):
                times[seq] = (base - timedelta(hours=4), base - timedelta(hours=hours[group]) + timedelta(seconds=k))
            i += n
        await _set_times(prod_url, prod_name, times)
        published = pkit.metrics.events_published.labels(AUDIT)._value.get()
        duplicates = ckit.metrics.events_duplicate.labels(AUDIT)._value.get()

        # The operator's command, as `python -m gpuaas.<service> replay --since ... --until ...` runs it.
        monkeypatch.setenv("GPUAAS_SERVICE_DATABASE_URL", prod_url)
        monkeypatch.setenv("GPUAAS_SERVICE_DB_SCHEMA", prod_name)
        since = (base - timedelta(hours=2, minutes=1)).isoformat()
        until = (base - timedelta(hours=1, minutes=30)).isoformat()
        argv = ["replay", "--since", since, "--until", until]
        await asyncio.to_thread(service_command, spec(prod_name), argv)
        assert f"requeued {groups['inside']} outbox rows" in capsys.readouterr().out

        await wait_for(lambda: _all_sent(outbox_rows()), 30, "the range published again")
        await wait_for(
            lambda: ckit.metrics.events_duplicate.labels(AUDIT)._value.get() >= duplicates + groups["inside"],
            60,
            "the consumer saw the replayed events again",
        )
        assert pkit.metrics.events_published.labels(AUDIT)._value.get() == published + groups["inside"]
        rows = await outbox_rows()
        for seq in by_group["before"] + by_group["after"]:
            assert rows[seq] == times[seq][1], f"row {seq} outside the range was republished"
        for seq in by_group["inside"]:
            assert rows[seq] is not None and rows[seq] > base - timedelta(minutes=5), f"row {seq} not republished"
        # Probes: one more event per subject, each behind that subject's events (replayed or not) in its
        # partition; once all are applied, anything else the replay could have caused has been consumed.
        async with pkit.sessions() as s, s.begin():
            await add_events(s, [audit_event(run, f"{g}-{i}", 100) for g, n in groups.items() for i in range(n)])
        total += sum(groups.values())  # one probe per subject
        await wait_for(lambda: _at_least(applied(), total), 60, "the probes applied")
        got = await applied()
        assert len(got) == total and len(set(got)) == total, "a replayed event was applied twice"


async def _at_least(rows_coro: Any, n: int) -> bool:
    return len(await rows_coro) >= n


async def _has(rows_coro: Any, n: int) -> bool:
    return len(await rows_coro) == n


async def _all_sent(rows_coro: Any) -> bool:
    rows = await rows_coro
    return bool(rows) and all(sent is not None for sent in rows.values())
