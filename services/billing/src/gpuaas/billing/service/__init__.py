"""Billing use cases, each one transaction: ledger rows + rollups + outbox events (+ audit for API
mutations) commit together. Rating runs in the consumer's transaction with the inbox row, so a
redelivered usage event is a no-op; the ledger's unique usage_record_id makes a re-published record
(new event id, same record) a no-op too.

- `rating`: usage events rated into the ledger (the consumer's use case), budget alerts;
- `prices`, `budgets`, `statements`: the API's mutations and their reads;
- `costs`, `ledger`: read views; `views`: the typed answers of all of them.
"""

from gpuaas.billing.service.budgets import budget_statuses, create_budget
from gpuaas.billing.service.costs import breakdown, costs, list_charges
from gpuaas.billing.service.ledger import ledger_balance
from gpuaas.billing.service.prices import list_prices, publish_price
from gpuaas.billing.service.rating import receive_usage
from gpuaas.billing.service.statements import close_statement, get_statement, list_statements

__all__ = [
    "breakdown",
    "budget_statuses",
    "close_statement",
    "costs",
    "create_budget",
    "get_statement",
    "ledger_balance",
    "list_charges",
    "list_prices",
    "list_statements",
    "publish_price",
    "receive_usage",
]
