"""Billing's consumers: GPU usage records and app usage records, rated into the ledger once each."""

from __future__ import annotations

from gpuaas.billing import service
from gpuaas.contracts.events import usage as us
from gpuaas.kit.subscriptions import Subscriptions

subscriptions = Subscriptions()
subscriptions.on(us.UsageRecorded)(service.receive_gpu_usage)
subscriptions.on(us.AppUsageRecorded)(service.receive_app_usage)
