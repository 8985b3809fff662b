# allocations: the minimal policy of its Vault/OpenBao token (AppRole `gpuaas-allocations`). Mount names are the chart's
# defaults (vault.kvMount, vault.transitMount); rename them here if yours differ.
# Its event-signing key (read at start; the version is checked to follow a rotation).
path "gpuaas-kv/data/allocations/event-signing" { capabilities = ["read"] }
path "gpuaas-kv/metadata/allocations/event-signing" { capabilities = ["read"] }
# Its secrets-at-rest keyring: data keys wrapped by its own Transit key, unwrapped at start.
path "gpuaas-kv/data/allocations/secrets-keys" { capabilities = ["read"] }
path "gpuaas-transit/decrypt/allocations" { capabilities = ["update"] }
