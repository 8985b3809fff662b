"""gpuaas.billing: Price book, rating, the ledger, cost views and budgets."""
