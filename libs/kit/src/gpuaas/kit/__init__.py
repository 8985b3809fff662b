"""gpuaas.kit: what every service shares — settings, db, outbox/inbox, auth/IAM, audit, errors, observability.

Import submodules explicitly (`from gpuaas.kit.outbox import add_event`); nothing heavy at import time.
"""
