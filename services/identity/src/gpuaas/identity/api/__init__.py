"""Identity's HTTP surface, one router per audience. Routers are thin: they parse, call one use case
(authorization happens inside it) and shape the answer; no SQL here.

Routes whose authorization happens inside the use case declare their permission action in the
OpenAPI document (`x-gpuaas-action`, see `deps.action`), like the kit does for `require(action)` routes.
"""

from fastapi import APIRouter

from gpuaas.identity.api import audit, auth, federation, oidc, service_accounts, tenants, users

routers: list[APIRouter] = [
    oidc.router,  # discovery, JWKS, the authorization endpoint, relying parties, key rotation
    auth.router,  # the token endpoint, logout
    federation.router,  # account discovery, SSO login, tenants' identity providers
    users.router,  # self-service and account administration
    tenants.router,  # tenants, projects, memberships
    service_accounts.router,
    audit.router,
]
