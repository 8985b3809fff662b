# catalog: the minimal policy of its Vault/OpenBao token (AppRole `gpuaas-catalog`). Mount names are the chart's
# defaults (vault.kvMount, vault.transitMount); rename them here if yours differ.
# Its event-signing key (read at start; the version is checked to follow a rotation).
path "gpuaas-kv/data/catalog/event-signing" { capabilities = ["read"] }
path "gpuaas-kv/metadata/catalog/event-signing" { capabilities = ["read"] }
