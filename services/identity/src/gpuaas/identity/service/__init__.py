"""Identity's use cases, one module per area (callers import the module: `tenants.create_tenant(...)`).

Each use case is one transaction (state + outbox events + audit record commit together), or, where
it must call out or hash a password, a few short ones with the slow work between them. Identity
applies its own events to its local IAM projection in the same transaction (`common.emit`), so its
own authorization decisions never lag behind its writes. Use cases answer contract states or the
view models of `views`.

- `tenants`: tenants and projects · `users`: accounts, memberships, `/me`
- `service_accounts`: project service accounts · `signing_keys`: key rotation
- `logins`: the password and client-credentials grants · `throttle`: brute-force protection
- `sessions`: sessions and rotating refresh tokens, logout
- `federation`: tenants' identity providers, account-type discovery · `sso`: SSO login and linking
- `domain_proofs`: re-verifying proven email domains (run by `reconciler`)
- `oidc_provider`: identity as an OpenID provider · `audit_store`: reading the audit trail
"""
