"""Billing's consumers: GPU and app usage records, rated into the ledger once each, a batch at a time."""

from __future__ import annotations

from gpuaas.billing.service import rating
from gpuaas.contracts.events import usage as usage_events
from gpuaas.kit.subscriptions import Subscriptions

subscriptions = Subscriptions()
subscriptions.on_batch(usage_events.UsageRecorded, usage_events.AppUsageRecorded)(rating.receive_usage)
