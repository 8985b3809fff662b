"""Billing export: a downstream consumer of `gpuaas.billing.v1` built on `gpuaas.contracts.faststream`.

Invoice lines per tenant, billing period and currency (project x SKU x app x unit) from `charge.posted`,
written into the consumer's own Postgres schema with exactly-once effects (the inbox and the charge id);
an export closes when `statement.closed` arrives for its tenant, period and currency and is reconciled
against the statement's total. A small read-only HTTP API serves the exports as JSON and CSV.
"""
