"""Containment rules: the operator's allow-list and the resolvers (no podman, no root needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuaas.node_agent.firewall import EgressPolicy, host_resolvers


def test_allow_list_entries_parse() -> None:
    policy = EgressPolicy.build(["0.0.0.0/0:443", "203.0.113.7", "[2001:db8::/32]:80-90"], ["10.0.0.2"])
    assert [(str(x.network), x.ports) for x in policy.allow or ()] == [
        ("0.0.0.0/0", (443, 443)),
        ("203.0.113.7/32", None),
        ("2001:db8::/32", (80, 90)),
    ]
    assert policy.resolvers == ("10.0.0.2",)
    assert EgressPolicy.build(None, []).allow is None  # no list: every destination that is not internal


@pytest.mark.parametrize("bad", ["203.0.113.0/24:0", "203.0.113.0/24:90-80", "[2001:db8::/32]x", "nonsense"])
def test_bad_allow_list_entries_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        EgressPolicy.build([bad], [])


def test_resolvers_come_from_resolv_conf_without_loopback(tmp_path: Path) -> None:
    conf = tmp_path / "resolv.conf"
    conf.write_text("# x\nnameserver 127.0.0.53\nnameserver 10.0.0.2\nnameserver fe80::1%eth0\nsearch example\n")
    assert host_resolvers(conf) == ["10.0.0.2", "fe80::1"]
