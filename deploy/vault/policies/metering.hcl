# metering: the minimal policy of its Vault/OpenBao token (AppRole `gpuaas-metering`). Mount names are the chart's
# defaults (vault.kvMount, vault.transitMount); rename them here if yours differ.
# Its event-signing key (read at start; the version is checked to follow a rotation).
path "gpuaas-kv/data/metering/event-signing" { capabilities = ["read"] }
path "gpuaas-kv/metadata/metering/event-signing" { capabilities = ["read"] }
