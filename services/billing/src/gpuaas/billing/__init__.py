"""gpuaas.billing: Price book, rating, the ledger, cost views and budgets."""

# The service's name, declared once: the SPEC's name, audit records' `service=`, events' `source=`.
SERVICE = "billing"
