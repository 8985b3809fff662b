# app-runtime: the minimal policy of its Vault/OpenBao token (AppRole `gpuaas-app-runtime`). Mount names are the
# chart's defaults (vault.kvMount, vault.transitMount); rename them here if yours differ.
# Its event-signing key (read at start; the version is checked to follow a rotation).
path "gpuaas-kv/data/app-runtime/event-signing" { capabilities = ["read"] }
path "gpuaas-kv/metadata/app-runtime/event-signing" { capabilities = ["read"] }
# Its secrets-at-rest keyring: data keys wrapped by its own Transit key, unwrapped at start.
path "gpuaas-kv/data/app-runtime/secrets-keys" { capabilities = ["read"] }
# Credential custody `vault`: the private keys of app instances' access credentials.
path "gpuaas-kv/data/app-runtime/credentials/*" { capabilities = ["create", "update", "read"] }
# Credential custody `transit` and the keyring: wrap, unwrap and re-wrap (the re-wrap job) with its own key,
# and read the key's latest version. Retiring old versions (keys/app-runtime/config) is the operator's.
path "gpuaas-transit/encrypt/app-runtime" { capabilities = ["update"] }
path "gpuaas-transit/decrypt/app-runtime" { capabilities = ["update"] }
path "gpuaas-transit/rewrap/app-runtime" { capabilities = ["update"] }
path "gpuaas-transit/keys/app-runtime" { capabilities = ["read"] }
