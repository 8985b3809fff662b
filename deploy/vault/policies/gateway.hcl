# gateway: the minimal policy of its Vault/OpenBao token (AppRole `gpuaas-gateway`). Mount names are the chart's
# defaults (vault.kvMount, vault.transitMount); rename them here if yours differ.
# Its event-signing key (read at start; the version is checked to follow a rotation).
path "gpuaas-kv/data/gateway/event-signing" { capabilities = ["read"] }
path "gpuaas-kv/metadata/gateway/event-signing" { capabilities = ["read"] }
