"""DNS as identity uses it, through the resolver the operator configures (`dns_nameservers`):
TXT records for domain-ownership challenges, and host addresses for the outbound guard.

The challenge: a tenant that claims `example.com` for its IdP publishes
`_gpuaas-challenge.example.com. TXT "gpuaas-domain-verification=<token>"`; identity looks it up and,
when one of the TXT strings is exactly that, the claim is proven.
"""

from __future__ import annotations

import dns.asyncresolver
import dns.nameserver
import dns.rdatatype
import dns.resolver

from gpuaas.identity.settings import Settings
from gpuaas.kit.outbound import Resolver

CHALLENGE_LABEL = "_gpuaas-challenge"
CHALLENGE_PREFIX = "gpuaas-domain-verification="


def challenge_name(domain: str) -> str:
    return f"{CHALLENGE_LABEL}.{domain}"


def challenge_value(token: str) -> str:
    return f"{CHALLENGE_PREFIX}{token}"


def _nameserver(spec: str) -> dns.nameserver.Do53Nameserver:
    """`ip`, `ip:port`, or `[ipv6]:port`."""
    if spec.startswith("["):
        host, _, port = spec[1:].partition("]:")
        return dns.nameserver.Do53Nameserver(host, int(port or 53))
    if spec.count(":") == 1:
        host, port = spec.split(":")
        return dns.nameserver.Do53Nameserver(host, int(port))
    return dns.nameserver.Do53Nameserver(spec)


def resolver_for(settings: Settings) -> dns.asyncresolver.Resolver:
    """The operator's resolver, or the system's (/etc/resolv.conf) when none is configured."""
    if settings.dns_nameservers:
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [_nameserver(s) for s in settings.dns_nameservers]
    else:
        resolver = dns.asyncresolver.Resolver()
    resolver.lifetime = settings.dns_timeout_s
    return resolver


async def txt_strings(resolver: dns.asyncresolver.Resolver, name: str) -> list[str]:
    """Every TXT string at `name` (character-strings of one record joined); none if it does not exist."""
    try:
        answer = await resolver.resolve(name, dns.rdatatype.TXT)
    except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
        return []
    out = []
    for rdata in answer:
        out.append(b"".join(rdata.strings).decode("utf-8", "replace"))
    return out


async def has_challenge(resolver: dns.asyncresolver.Resolver, domain: str, token: str) -> bool:
    return challenge_value(token) in await txt_strings(resolver, challenge_name(domain))


def address_resolver(resolver: dns.asyncresolver.Resolver) -> Resolver:
    """A host resolver for the outbound guard (A and AAAA through the operator's resolver)."""

    async def resolve(host: str) -> list[str]:
        out: list[str] = []
        for rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
            try:
                out += [r.to_text() for r in await resolver.resolve(host, rdtype)]
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                continue
        return out

    return resolve
