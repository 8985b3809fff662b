"""The per-instance workload secret (issue 21): deterministic for the holders of the key, distinct per
instance and per key, and refused without a real key."""

from __future__ import annotations

import uuid

import pytest

from gpuaas.kit import workload_tokens


def test_derived_per_instance_and_key() -> None:
    key, other_key = b"k" * 32, b"x" * 32
    a, b = uuid.uuid4(), uuid.uuid4()
    assert workload_tokens.derive(key, a) == workload_tokens.derive(key, str(a))  # allocations and gateway agree
    assert workload_tokens.derive(key, a) != workload_tokens.derive(key, b)
    assert workload_tokens.derive(key, a) != workload_tokens.derive(other_key, a)
    assert len(workload_tokens.derive(key, a)) == 43  # 256 bits, url-safe, no padding
    with pytest.raises(ValueError):
        workload_tokens.derive(key, "../etc")


def test_key_from_env_refuses_a_missing_or_short_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(workload_tokens.ENV, raising=False)
    with pytest.raises(workload_tokens.WorkloadTokenKeyMissing):
        workload_tokens.key_from_env()
    monkeypatch.setenv(workload_tokens.ENV, "short")
    with pytest.raises(workload_tokens.WorkloadTokenKeyMissing):
        workload_tokens.key_from_env()
    monkeypatch.setenv(workload_tokens.ENV, "s" * 40)
    assert workload_tokens.key_from_env() == b"s" * 40
