"""Metering use cases, each one transaction: meter state + usage records + outbox events (+ an audit
record for API mutations) commit together or not at all.

- `meters`: allocation and host events applied to meters, the window closer's pass, meter reads;
- `app_usage`: the app instance projection and the app usage producer API;
- `views`: the typed answers of both.
"""

from gpuaas.metering.service.app_usage import apply_instance, apply_member, list_app_usage, record_app_usage
from gpuaas.metering.service.meters import (
    apply_allocation,
    apply_host,
    close_due_windows,
    get_meter,
    list_meters,
    meter_usage,
)

__all__ = [
    "apply_allocation",
    "apply_host",
    "apply_instance",
    "apply_member",
    "close_due_windows",
    "get_meter",
    "list_app_usage",
    "list_meters",
    "meter_usage",
    "record_app_usage",
]
