"""Identity's runtime state, built at startup and read with `kit.state_as(IdentityRuntime)`."""

from __future__ import annotations

from dataclasses import dataclass

import dns.asyncresolver

from gpuaas.identity.idp import IdpMetadata


@dataclass
class IdentityRuntime:
    # Discovery documents and JWKS of tenants' enterprise IdPs, cached across SSO logins.
    idp_metadata: IdpMetadata
    # The operator's DNS resolver (domain-ownership challenges, IdP host addresses).
    resolver: dns.asyncresolver.Resolver
