"""The price book: publishing a price (which rates the usage waiting for it) and reading the book."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.billing import SERVICE, domain
from gpuaas.billing.models import charges, prices, usage_received
from gpuaas.billing.service import rating
from gpuaas.billing.service.views import Price
from gpuaas.contracts import new_event_id
from gpuaas.contracts.enums import CapacityShape
from gpuaas.contracts.events import billing as billing_events
from gpuaas.contracts.events.billing import PriceUnit
from gpuaas.kit import audit, iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, Unprocessable
from gpuaas.kit.outbox import add_events


def _sku(unit: PriceUnit, gpu_model: str | None, shape: CapacityShape | None, app_slug: str | None) -> str:
    """The SKU a price targets: GPU time by model and shape, or an app unit by app."""
    if unit is PriceUnit.gpu_hour:
        if not gpu_model or shape is None or app_slug:
            raise Unprocessable("a gpu_hour price needs gpu_model and shape (and no app_slug)", code="price_target")
        return domain.gpu_sku(gpu_model, str(shape))
    if not app_slug or gpu_model or shape is not None:
        raise Unprocessable("an app unit price needs app_slug (and no gpu_model/shape)", code="price_target")
    return domain.app_sku(app_slug, str(unit))


async def publish_price(
    session: AsyncSession,
    principal: Principal,
    *,
    unit: PriceUnit,
    unit_price: Decimal,
    currency: str,
    gpu_model: str | None,
    shape: CapacityShape | None,
    app_slug: str | None,
    effective_from: datetime,
    description: str,
) -> Price:
    """Publish a price: it supersedes the SKU's current price from `effective_from` and rates the
    SKU's waiting usage from then on. It may not be dated before usage already charged on the SKU
    (charges are never rewritten)."""
    await iam.authorize(session, principal, "billing.price.manage")
    sku = _sku(unit, gpu_model, shape, app_slug)
    await session.execute(select(func.pg_advisory_xact_lock(func.hashtext("price:" + sku))))
    current = (
        await session.execute(
            select(prices).where(prices.c.sku == sku).order_by(prices.c.effective_from.desc()).limit(1)
        )
    ).first()
    if current is not None and effective_from <= current.effective_from:
        raise Conflict(
            f"{sku} already has a price from {current.effective_from.isoformat()}; a new one must start later",
            code="price_not_after_current",
        )
    charged_after = (
        await session.execute(select(func.max(charges.c.usage_start)).where(charges.c.sku == sku))
    ).scalar_one()
    if charged_after is not None and effective_from <= charged_after:
        raise Conflict(
            f"usage of {sku} up to {charged_after.isoformat()} is already charged; the price must start later",
            code="price_would_rewrite_charges",
        )
    price_id = new_event_id()
    if current is not None:
        await session.execute(
            update(prices).where(prices.c.price_id == current.price_id).values(effective_to=effective_from)
        )
    values: dict[str, Any] = {
        "price_id": price_id,
        "sku": sku,
        "description": description,
        "unit": str(unit),
        "unit_price": unit_price,
        "currency": currency,
        "gpu_model": gpu_model,
        "shape": str(shape) if shape else None,
        "app_slug": app_slug,
        "effective_from": effective_from,
        "effective_to": None,
    }
    await session.execute(insert(prices).values(**values, created_by=str(principal.subject)))
    state = billing_events.PriceState(**values)
    await add_events(session, [billing_events.PricePublished.build(data=state, source=SERVICE, actor=principal.actor)])
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="billing.price.publish",
        resource_type="price",
        resource_id=price_id,
        before=_price_json(current),
        after=state.model_dump(mode="json"),
    )
    # Rate what was waiting for this SKU and falls in the new price's range. The SKU's first price also
    # rates the usage dated before it: that usage had no price at all and was waiting for this one
    # (rating.PriceBook.at does the same for such usage arriving later).
    price = (await session.execute(select(prices).where(prices.c.price_id == price_id))).one()
    in_range = [usage_received.c.usage_start >= effective_from] if current is not None else []
    waiting = (
        await session.execute(
            select(usage_received)
            .where(usage_received.c.sku == sku, usage_received.c.status == "unrated", *in_range)
            .with_for_update(skip_locked=True)
        )
    ).all()
    await rating.post_charges(session, [(rating.Usage.of_row(u), price) for u in waiting])
    # The price as given (its digits unrounded by the column), with how much waiting usage it rated.
    return Price(**values, rated_waiting_usage=len(waiting))


async def list_prices(session: AsyncSession, *, sku: str | None, current: bool) -> list[Price]:
    """The price book (every authenticated caller may read it), by SKU then start."""
    q = select(prices).order_by(prices.c.sku, prices.c.effective_from)
    if sku:
        q = q.where(prices.c.sku == sku)
    if current:
        q = q.where(prices.c.effective_to.is_(None))
    return [Price.model_validate(r) for r in (await session.execute(q)).all()]


def _price_json(row: Any) -> dict[str, Any] | None:
    if row is None:
        return None
    return {
        "price_id": str(row.price_id),
        "unit_price": str(row.unit_price),
        "currency": row.currency,
        "effective_from": row.effective_from.isoformat(),
    }
