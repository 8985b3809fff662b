"""The ledger check for operators: debits and credits per currency, and any unbalanced transaction."""

from __future__ import annotations

from decimal import Decimal

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.billing.models import ledger_entries, ledger_transactions
from gpuaas.billing.service.views import CurrencyBalance, LedgerBalance
from gpuaas.kit import iam
from gpuaas.kit.auth import Principal


async def ledger_balance(session: AsyncSession, principal: Principal) -> LedgerBalance:
    """Sum of debits and credits per currency; `balanced` must always be true."""
    await iam.authorize(session, principal, "platform.admin")
    debits = func.sum(ledger_entries.c.amount).filter(ledger_entries.c.side == "debit")
    credits = func.sum(ledger_entries.c.amount).filter(ledger_entries.c.side == "credit")
    rows = (
        await session.execute(
            select(
                ledger_entries.c.currency, func.coalesce(debits, 0), func.coalesce(credits, 0), func.count()
            ).group_by(ledger_entries.c.currency)
        )
    ).all()
    unbalanced = (
        await session.execute(
            select(func.count()).select_from(
                select(ledger_entries.c.transaction_id)
                .group_by(ledger_entries.c.transaction_id, ledger_entries.c.currency)
                .having(debits != credits)
                .subquery()
            )
        )
    ).scalar_one()
    transactions = (await session.execute(select(func.count()).select_from(ledger_transactions))).scalar_one()
    currencies = [
        CurrencyBalance(currency=c, debits=Decimal(d), credits=Decimal(cr), entries=n) for c, d, cr, n in rows
    ]
    return LedgerBalance(
        transactions=transactions,
        currencies=currencies,
        unbalanced_transactions=unbalanced,
        balanced=unbalanced == 0 and all(c.debits == c.credits for c in currencies),
    )
