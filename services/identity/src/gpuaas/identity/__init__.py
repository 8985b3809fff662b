"""gpuaas.identity: Tenants, projects, users, memberships, service accounts, tokens and the audit store."""
