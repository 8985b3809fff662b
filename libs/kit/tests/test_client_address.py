"""The caller's address behind proxies (gpuaas.kit.client_address): X-Forwarded-For is believed only through
trusted proxies, so a client cannot choose the address that rate limits, lockouts and audit see."""

from __future__ import annotations

import pytest

from gpuaas.kit.client_address import client_address, forwarded_chain, is_trusted

PROXIES = ("10.0.0.0/8", "192.0.2.7", "fd00::/8")


def test_without_a_trusted_peer_the_peer_is_the_caller() -> None:
    assert client_address("203.0.113.9", "1.2.3.4", PROXIES) == "203.0.113.9"  # a client's own header is ignored
    assert client_address("203.0.113.9", None, PROXIES) == "203.0.113.9"
    assert client_address("10.1.2.3", "1.2.3.4", ()) == "10.1.2.3"  # nothing trusted: nothing believed


def test_through_trusted_proxies_the_right_most_untrusted_hop_is_the_caller() -> None:
    # the client wrote "6.6.6.6" itself; our proxies appended 198.51.100.4 (the caller) and 10.0.0.5
    assert client_address("192.0.2.7", "6.6.6.6, 198.51.100.4, 10.0.0.5", PROXIES) == "198.51.100.4"
    assert client_address("10.0.0.1", " 198.51.100.4 ", PROXIES) == "198.51.100.4"


def test_when_every_hop_is_trusted_the_left_most_is_the_caller() -> None:
    assert client_address("10.0.0.1", "10.9.9.9, 10.0.0.5", PROXIES) == "10.9.9.9"


def test_an_empty_header_from_a_trusted_proxy_leaves_the_peer() -> None:
    assert client_address("10.0.0.1", " , ", PROXIES) == "10.0.0.1"
    assert client_address(None, "1.2.3.4", PROXIES) == "unknown"


@pytest.mark.parametrize(
    ("address", "trusted"),
    [
        ("10.255.0.1", True),
        ("192.0.2.7", True),
        ("192.0.2.8", False),  # an exact address is a /32
        ("::ffff:10.0.0.1", True),  # IPv4-mapped IPv6 is the IPv4 address
        ("[fd00::1]", True),
        ("fe80::1", False),
        ("unknown", False),  # what a proxy may write for a hop it could not see: never trusted
        ("proxy.internal", False),
        ("", False),
        (None, False),
    ],
)
def test_which_hops_are_trusted(address: str | None, trusted: bool) -> None:
    assert is_trusted(address, PROXIES) is trusted


def test_a_trusted_entry_that_is_no_address_or_network_is_an_error() -> None:
    with pytest.raises(ValueError):
        is_trusted("10.0.0.1", ("10.0.0.0/33",))


def test_the_chain_sent_upstream_starts_at_the_callers_address() -> None:
    # hops the client wrote on its own (left of the caller) are dropped; the peer is appended
    assert forwarded_chain("10.0.0.5", ["6.6.6.6, 198.51.100.4", "10.0.0.9"], PROXIES) == [
        "198.51.100.4",
        "10.0.0.9",
        "10.0.0.5",
    ]
    assert forwarded_chain("203.0.113.9", ["6.6.6.6"], PROXIES) == ["203.0.113.9"]  # untrusted peer: only itself
    assert forwarded_chain(None, ["6.6.6.6"], PROXIES) == ["unknown"]
    assert forwarded_chain("10.0.0.5", ["10.0.0.9"], PROXIES) == ["10.0.0.9", "10.0.0.5"]  # all trusted: all kept
