"""gpuaas.identity: Tenants, projects, users, memberships, service accounts, tokens and the audit store."""

# The service's name, declared once: the SPEC's name, audit records' `service=` and events' `source=`.
SERVICE = "identity"
