"""Billing's consumers: GPU and app usage records, rated into the ledger once each, a batch at a time."""

from __future__ import annotations

from gpuaas.billing import rating
from gpuaas.contracts.events import usage as us
from gpuaas.kit.subscriptions import Subscriptions

subscriptions = Subscriptions()
subscriptions.on_batch(us.UsageRecorded, us.AppUsageRecorded)(rating.receive_usage)
