"""The isolation rules without I/O: limits of a container, runtime references, version order, tenancy."""

from __future__ import annotations

import pytest

from gpuaas.allocations import domain
from gpuaas.kit.errors import Unprocessable


def test_limits_from_class_figures_times_gpus() -> None:
    figures = domain.ClassFigures(cpus_per_gpu=2.5, memory_mb_per_gpu=8192, pids_limit=1024)
    limits = domain.allocation_limits(figures, gpu_count=3, host_cpus=64, host_memory_mb=512_000, host_gpus=8)
    assert limits == {"cpus": 7.5, "memory_mb": 24576, "pids": 1024}


def test_limits_from_the_host_share_where_the_class_sets_nothing() -> None:
    limits = domain.allocation_limits(None, gpu_count=2, host_cpus=16, host_memory_mb=65536, host_gpus=8)
    assert limits == {"cpus": 4.0, "memory_mb": 16384, "pids": domain.DEFAULT_PIDS_LIMIT}
    # One figure from the class, the other from the share.
    half = domain.ClassFigures(cpus_per_gpu=1.0)
    assert domain.allocation_limits(half, gpu_count=2, host_cpus=16, host_memory_mb=65536, host_gpus=8) == {
        "cpus": 2.0,
        "memory_mb": 16384,
        "pids": domain.DEFAULT_PIDS_LIMIT,
    }
    # Unknown host figures and no class: nothing to enforce.
    assert domain.allocation_limits(None, gpu_count=1, host_cpus=None, host_memory_mb=None, host_gpus=8) is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("gpuaas-base", domain.RuntimeSpec(slug="gpuaas-base")),
        ("gpuaas-base@1.2.0", domain.RuntimeSpec(slug="gpuaas-base", version="1.2.0")),
        ("sha256:" + "a" * 64, domain.RuntimeSpec(digest="sha256:" + "a" * 64)),
    ],
)
def test_runtime_reference_forms(value: str, expected: domain.RuntimeSpec) -> None:
    assert domain.parse_runtime_spec(value) == expected


@pytest.mark.parametrize("value", ["", "Base", "gpuaas-base@", "sha256:abc", "a b", "@1.0.0"])
def test_runtime_reference_refused(value: str) -> None:
    with pytest.raises(Unprocessable) as err:
        domain.parse_runtime_spec(value)
    assert err.value.code == "runtime_unavailable"


def test_versions_order_numerically_with_pre_releases_first() -> None:
    versions = ["1.9.0", "1.10.0", "1.10.0-rc1", "0.1.0", "2.0.0"]
    assert sorted(versions, key=domain.version_key) == ["0.1.0", "1.9.0", "1.10.0-rc1", "1.10.0", "2.0.0"]


def test_tenancy_rule() -> None:
    assert domain.tenancy_allows(isolates_tenants=True, shared_tenancy_allowed=False, other_tenants_present=True)
    assert domain.tenancy_allows(isolates_tenants=False, shared_tenancy_allowed=True, other_tenants_present=True)
    assert domain.tenancy_allows(isolates_tenants=False, shared_tenancy_allowed=False, other_tenants_present=False)
    assert not domain.tenancy_allows(isolates_tenants=False, shared_tenancy_allowed=False, other_tenants_present=True)
