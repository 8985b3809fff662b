"""Rating usage into the ledger, a consumed batch at a time.

The consumer hands billing every usage event of a batch at once (`Subscriptions.on_batch`), and the
batch is rated with a fixed number of statements, not a dozen per event: one insert claims the usage
records (the primary key on usage_record_id makes a re-published record a no-op: charged at most once),
one query reads the SKUs' prices, then one fixed-shape insert (unnest of arrays, `kit.bulk`) each for
ledger transactions, ledger entries and charges, one update, one spend upsert per project, the budget
checks per project and the outbox rows. The ledger's balance is checked once per database transaction at
commit (billing_0003), not per entry row.
Everything runs in the consumer's transaction with the inbox rows (and publish_price's, when waiting
usage is rated by a new price).
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import func, or_, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.billing import SERVICE, domain
from gpuaas.billing.metrics import usage_rated
from gpuaas.billing.models import (
    budget_alerts,
    budgets,
    charges,
    ledger_entries,
    ledger_transactions,
    periods,
    prices,
    spend,
    usage_received,
)
from gpuaas.contracts import Actor, Event, new_event_id
from gpuaas.contracts.events import billing as billing_events
from gpuaas.contracts.events import usage as usage_events
from gpuaas.contracts.events.billing import PriceUnit
from gpuaas.kit.bulk import insert_rows
from gpuaas.kit.errors import Problem
from gpuaas.kit.logging import get_logger
from gpuaas.kit.outbox import add_events

SYSTEM = Actor.system(SERVICE)
log = get_logger(__name__)
MARK_RATED = text("UPDATE usage_received SET status = 'rated' WHERE usage_record_id = ANY(CAST(:ids AS uuid[]))")


@dataclass(frozen=True)
class Usage:
    """One usage record as billing receives it (a `usage_received` row): GPU time or app usage."""

    usage_record_id: uuid.UUID
    usage_kind: str  # gpu | app
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    sku: str
    unit: str
    raw_quantity: Decimal  # GPU-seconds, or app units
    usage_start: datetime
    usage_end: datetime
    allocation_id: uuid.UUID | None
    instance_id: uuid.UUID | None
    app_slug: str | None
    event_time: datetime

    @classmethod
    def of_row(cls, row: Any) -> Usage:
        return cls(**{f: getattr(row, f) for f in cls.__dataclass_fields__})

    @classmethod
    def of_event(cls, event: Event) -> Usage:
        """The usage of a GPU or an app usage event."""
        if isinstance(event, usage_events.UsageRecorded):
            gpu = event.data
            return cls(
                usage_record_id=gpu.usage_record_id,
                usage_kind="gpu",
                tenant_id=gpu.tenant_id,
                project_id=gpu.project_id,
                sku=domain.gpu_sku(gpu.gpu_model, str(gpu.shape)),
                unit=str(PriceUnit.gpu_hour),
                raw_quantity=gpu.gpu_seconds,
                usage_start=gpu.window_start,
                usage_end=gpu.window_end,
                allocation_id=gpu.allocation_id,
                instance_id=gpu.instance_id,  # the app instance on the allocation, when metering knows one
                app_slug=None,
                event_time=event.time,
            )
        if isinstance(event, usage_events.AppUsageRecorded):
            app = event.data
            return cls(
                usage_record_id=app.app_usage_record_id,
                usage_kind="app",
                tenant_id=app.tenant_id,
                project_id=app.project_id,
                sku=domain.app_sku(app.app_slug, str(app.unit)),
                unit=str(app.unit),
                raw_quantity=app.quantity,
                usage_start=app.occurred_at,
                usage_end=app.occurred_at,
                allocation_id=None,
                instance_id=app.instance_id,
                app_slug=app.app_slug,
                event_time=event.time,
            )
        raise TypeError(f"not a usage event: {event.type}")


async def receive_usage(session: AsyncSession, events: Sequence[Event]) -> None:
    """Record each usage once; rate those whose SKU has a price at their time, keep the rest unrated
    (a price published later rates them)."""
    causes: dict[uuid.UUID, Event] = {}
    usages: list[Usage] = []
    for event in events:
        usage = Usage.of_event(event)
        if usage.usage_record_id not in causes:  # a record twice in one batch (a replay): once
            causes[usage.usage_record_id] = event
            usages.append(usage)
    if not usages:
        return
    claimed = {
        row.usage_record_id
        for row in await insert_rows(
            session,
            usage_received,
            [{**vars(u), "status": "unrated"} for u in usages],  # vars, not asdict (a deep copy: ~0.8 ms an event)
            on_conflict_do_nothing=True,
            returning=("usage_record_id",),
        )
    }
    fresh = [u for u in usages if u.usage_record_id in claimed]
    if not fresh:
        return  # all already received (re-published records)
    book = await PriceBook.load(session, {u.sku for u in fresh})
    priced = []
    for u in fresh:
        price = book.at(u.sku, u.usage_start)
        if price is None:
            log.warning("usage_unrated_no_price", sku=u.sku, usage_record_id=str(u.usage_record_id))
        else:
            priced.append((u, price))
    await post_charges(session, priced, causes)


class PriceBook:
    """The prices of some SKUs, read in one query; `at` picks the one in effect at a time."""

    def __init__(self, rows: Iterable[Any]) -> None:
        self.by_sku: dict[str, list[Any]] = defaultdict(list)
        for row in sorted(rows, key=lambda r: r.effective_from, reverse=True):
            self.by_sku[row.sku].append(row)

    @classmethod
    async def load(cls, session: AsyncSession, skus: set[str]) -> PriceBook:
        return cls((await session.execute(select(prices).where(prices.c.sku.in_(sorted(skus))))).all())

    def at(self, sku: str, when: datetime) -> Any:
        """The price in effect at `when`; usage dated before the SKU's first price takes that first price
        (it had none, so it was waiting for it: a price published now rates the minutes before it too)."""
        book = self.by_sku.get(sku, [])
        for row in book:  # newest first
            if row.effective_from <= when and (row.effective_to is None or row.effective_to > when):
                return row
        if book and when < book[-1].effective_from:
            return book[-1]
        return None


async def period_for(session: AsyncSession, tenant_id: uuid.UUID, usage_start: datetime) -> datetime:
    """The open period a charge counts in; held FOR SHARE so a statement cannot close under it."""
    for start in (domain.month_start(usage_start), domain.month_start(datetime.now(UTC))):
        await session.execute(
            pg_insert(periods).values(tenant_id=tenant_id, period_start=start).on_conflict_do_nothing()
        )
        row = (
            await session.execute(
                select(periods.c.status)
                .where(periods.c.tenant_id == tenant_id, periods.c.period_start == start)
                .with_for_update(read=True)
            )
        ).one()
        if row.status == "open":
            return start
    raise Problem("the current billing period is closed", code="period_closed", status=409)


async def post_charges(
    session: AsyncSession, priced: Sequence[tuple[Usage, Any]], causes: dict[uuid.UUID, Event] | None = None
) -> None:
    """Charge each (usage, price): a balanced ledger transaction, a charge, the spend rollup, the budget
    checks and a charge.posted event each; the usage rows become `rated`. A charge.posted carries the
    correlation of the usage event that caused it (`causes`, by usage record id) when there is one."""
    if not priced:
        return
    period_of: dict[tuple[uuid.UUID, datetime], datetime] = {}
    transactions, entries, charge_rows, events = [], [], [], []
    spent_delta: dict[tuple[uuid.UUID, uuid.UUID, datetime, str], dict[str, Decimal]] = defaultdict(
        lambda: {"gpu_amount": Decimal(0), "app_amount": Decimal(0)}
    )
    posted_at = datetime.now(UTC)
    for usage, price in priced:
        rated = domain.rate(price.unit, Decimal(usage.raw_quantity), Decimal(price.unit_price))
        tenant_id, project_id = usage.tenant_id, usage.project_id
        month = (tenant_id, domain.month_start(usage.usage_start))
        if month not in period_of:
            period_of[month] = await period_for(session, tenant_id, usage.usage_start)
        period_start = period_of[month]
        transaction_id, charge_id = new_event_id(), new_event_id()
        transactions.append(
            {
                "transaction_id": transaction_id,
                "usage_record_id": usage.usage_record_id,
                "tenant_id": tenant_id,
                "currency": price.currency,
                "memo": f"{usage.usage_kind} usage {usage.usage_record_id} at {price.sku}",
                "posted_at": posted_at,
            }
        )
        entries.extend(
            {
                "entry_id": new_event_id(),
                "transaction_id": transaction_id,
                "account": account,
                "side": side,
                "amount": amount,
                "currency": price.currency,
            }
            for account, side, amount in domain.postings(tenant_id, price.sku, rated.amount)
        )
        values = {
            "charge_id": charge_id,
            "transaction_id": transaction_id,
            "usage_record_id": usage.usage_record_id,
            "usage_kind": usage.usage_kind,
            "tenant_id": tenant_id,
            "project_id": project_id,
            "sku": price.sku,
            "price_id": price.price_id,
            "quantity": rated.quantity,
            "unit": price.unit,
            "unit_price": price.unit_price,
            "amount": rated.amount,
            "currency": price.currency,
            "allocation_id": usage.allocation_id,
            "instance_id": usage.instance_id,
            "app_slug": usage.app_slug,
            "usage_start": usage.usage_start,
            "usage_end": usage.usage_end,
            "period_start": period_start,
            "posted_at": posted_at,
        }
        charge_rows.append(values)
        column = "gpu_amount" if usage.usage_kind == "gpu" else "app_amount"
        spent_delta[(tenant_id, project_id, period_start, price.currency)][column] += rated.amount
        charge = billing_events.ChargeState(**values)
        posted = billing_events.ChargePosted.build(data=charge, source=SERVICE, actor=SYSTEM)
        cause = (causes or {}).get(usage.usage_record_id)
        if cause is not None:
            posted.correlation_id, posted.causation_id = cause.correlation_id, cause.id
        events.append(posted)

    # Fixed-shape statements (unnest of arrays): compiled and prepared once, whatever the batch size.
    await insert_rows(session, ledger_transactions, transactions)
    await insert_rows(session, ledger_entries, entries)
    await insert_rows(session, charges, charge_rows)
    await session.execute(MARK_RATED, {"ids": [u.usage_record_id for u, _ in priced]})
    rollup = [
        {"tenant_id": t, "project_id": p, "period_start": ps, "currency": c, **amounts}
        for (t, p, ps, c), amounts in spent_delta.items()
    ]
    stmt = pg_insert(spend).values(rollup)
    await session.execute(
        stmt.on_conflict_do_update(
            constraint="pk_spend",
            set_={
                "gpu_amount": spend.c.gpu_amount + stmt.excluded.gpu_amount,
                "app_amount": spend.c.app_amount + stmt.excluded.app_amount,
            },
        )
    )
    for tenant_id, project_id, period_start, currency in spent_delta:
        events += await project_budget_alerts(session, tenant_id, project_id, period_start, currency)
    await add_events(session, events)
    usage_rated(session, [(usage.usage_kind, usage.event_time) for usage, _ in priced], posted_at)


async def spent(
    session: AsyncSession, tenant_id: uuid.UUID, project_id: uuid.UUID | None, period_start: datetime, currency: str
) -> Decimal:
    q = select(func.coalesce(func.sum(spend.c.gpu_amount + spend.c.app_amount), 0)).where(
        spend.c.tenant_id == tenant_id, spend.c.period_start == period_start, spend.c.currency == currency
    )
    if project_id is not None:
        q = q.where(spend.c.project_id == project_id)
    return Decimal((await session.execute(q)).scalar_one())


async def project_budget_alerts(
    session: AsyncSession, tenant_id: uuid.UUID, project_id: uuid.UUID, period_start: datetime, currency: str
) -> list[Event]:
    """Alerts of the tenant's and the project's budgets whose thresholds the period's spend reached."""
    rows = (
        await session.execute(
            select(budgets).where(
                budgets.c.tenant_id == tenant_id,
                budgets.c.currency == currency,
                or_(budgets.c.project_id.is_(None), budgets.c.project_id == project_id),
            )
        )
    ).all()
    events: list[Event] = []
    for b in rows:
        events += await alerts_for(session, b, period_start)
    return events


async def alerts_for(session: AsyncSession, b: Any, period_start: datetime) -> list[Event]:
    """A budget's newly reached thresholds in a period, each recorded once (an alert is never repeated)."""
    amount = await spent(session, b.tenant_id, b.project_id, period_start, b.currency)
    events: list[Event] = []
    for t in domain.reached_thresholds(Decimal(b.limit_amount), amount, list(b.thresholds)):
        crossed_at = datetime.now(UTC)
        new = (
            await session.execute(
                pg_insert(budget_alerts)
                .values(
                    budget_id=b.budget_id,
                    period_start=period_start,
                    threshold_percent=t,
                    spent_amount=amount,
                    crossed_at=crossed_at,
                )
                .on_conflict_do_nothing()
                .returning(budget_alerts.c.budget_id)
            )
        ).first()
        if new is None:
            continue
        data = billing_events.BudgetThreshold(
            budget_id=b.budget_id,
            tenant_id=b.tenant_id,
            project_id=b.project_id,
            period_start=period_start,
            period_end=domain.next_month(period_start),
            limit_amount=b.limit_amount,
            spent_amount=amount,
            currency=b.currency,
            threshold_percent=t,
            crossed_at=crossed_at,
        )
        events.append(billing_events.BudgetThresholdCrossed.build(data=data, source=SERVICE, actor=SYSTEM))
    return events
