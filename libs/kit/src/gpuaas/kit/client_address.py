"""The caller's address behind proxies: `X-Forwarded-For` believed only through a configured list of
trusted proxies (exact addresses or CIDR networks), taking the right-most hop that is not one of them.

Each proxy appends the address it received the request from, so the right end of the chain is written
by proxies we trust and the left end by the client (who can put anything there). Walking from the right
and stopping at the first untrusted hop gives the address of whoever spoke to our outermost trusted
proxy: a client cannot choose it. When every hop is trusted (e.g. a test client on the same loopback as
the gateway), the left-most hop is the answer.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from functools import lru_cache

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@lru_cache(maxsize=64)
def trusted_networks(trusted: tuple[str, ...]) -> tuple[Network, ...]:
    """`trusted` entries as networks (an address is a /32 or /128); ValueError for one that is neither."""
    return tuple(ipaddress.ip_network(t.strip(), strict=False) for t in trusted if t.strip())


def is_trusted(address: str | None, trusted: Iterable[str]) -> bool:
    if not address:
        return False
    try:
        ip = ipaddress.ip_address(address.strip().strip("[]"))
    except ValueError:
        return False  # "unknown", a hostname, garbage: never a trusted proxy
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in net for net in trusted_networks(tuple(trusted)))


def client_address(peer: str | None, forwarded_for: str | None, trusted: Iterable[str]) -> str:
    """The caller's address: the TCP peer, or, when the peer is a trusted proxy, the right-most
    X-Forwarded-For hop that is not a trusted proxy (the left-most when all are)."""
    trusted = tuple(trusted)
    if not peer or not forwarded_for or not is_trusted(peer, trusted):
        return peer or "unknown"
    hops = [h.strip() for h in forwarded_for.split(",") if h.strip()]
    for hop in reversed(hops):
        if not is_trusted(hop, trusted):
            return hop
    return hops[0] if hops else peer


def forwarded_chain(peer: str | None, forwarded_for: list[str], trusted: Iterable[str]) -> list[str]:
    """The X-Forwarded-For chain to send upstream: the peer appended to what it claimed, cut so that it
    starts at the client's address (the hops a client wrote on its own are dropped); from an untrusted
    peer, only the peer."""
    trusted = tuple(trusted)
    me = peer or "unknown"
    if not is_trusted(me, trusted):
        return [me]
    hops = [h.strip() for v in forwarded_for for h in v.split(",") if h.strip()]
    chain = [*hops, me]
    for i in range(len(chain) - 1, -1, -1):
        if not is_trusted(chain[i], trusted):
            return chain[i:]
    return chain
