"""Token buckets: unit behaviour and 429s from a running gateway, both on a fake clock (buckets refill
only when the test moves the clock, so a slow machine cannot turn a refusal into a refill)."""

from __future__ import annotations

import httpx

from gpuaas.gateway.ratelimit import TokenBucketLimiter


def test_bucket_allows_burst_then_refills_at_rate(clock):
    limiter = TokenBucketLimiter(2.0, 3, clock=clock)
    assert [limiter.take("a").allowed for _ in range(4)] == [True, True, True, False]
    refused = limiter.take("a")
    assert refused.retry_after_s == 1
    assert limiter.take("b").allowed  # another principal has its own bucket
    clock.advance(0.5)  # one token back at 2/s
    assert limiter.take("a").allowed
    assert not limiter.take("a").allowed


def test_retry_after_reflects_the_rate(clock):
    limiter = TokenBucketLimiter(0.1, 1, clock=clock)
    assert limiter.take("a").allowed
    assert limiter.take("a").retry_after_s == 10


def test_idle_full_buckets_are_pruned_busy_ones_kept(clock):
    limiter = TokenBucketLimiter(10.0, 10, prune_interval_s=60, clock=clock)
    limiter.take("idle")
    clock.advance(30)
    for _ in range(10):
        limiter.take("busy")
    assert len(limiter) == 2
    assert limiter.prune() == 1
    assert len(limiter) == 1
    clock.advance(61)  # the next take prunes on its own
    limiter.take("new")
    assert len(limiter) == 1


def test_zero_rate_disables_limiting():
    limiter = TokenBucketLimiter(0, 1)
    assert all(limiter.take("a").allowed for _ in range(100))
    assert len(limiter) == 0


async def test_gateway_answers_429_after_burst_per_principal(stack, clock):
    gateway = await stack.gateway(clock=clock, rate_limit_per_s=0.5, rate_limit_burst=3)
    alice, bob = stack.bearer(), stack.bearer()
    async with httpx.AsyncClient(base_url=gateway) as client:
        statuses = [(await client.get("/api/catalog/echo", headers=alice)).status_code for _ in range(3)]
        limited = await client.get("/api/catalog/echo", headers=alice)
        other = await client.get("/api/catalog/echo", headers=bob)
        clock.advance(1.9)  # not yet a whole token back at 0.5/s
        still_limited = await client.get("/api/catalog/echo", headers=alice)
        clock.advance(2.0)  # the Retry-After has passed
        refilled = await client.get("/api/catalog/echo", headers=alice)
        metrics = await client.get("/metrics")
    assert statuses == [200, 200, 200]
    assert limited.status_code == 429
    assert limited.headers["content-type"] == "application/problem+json"
    assert limited.json()["code"] == "rate_limited"
    assert limited.headers["retry-after"] == "2"
    assert other.status_code == 200
    assert still_limited.status_code == 429
    assert refilled.status_code == 200
    assert 'gpuaas_rate_limited_total{service="gateway"} 2.0' in metrics.text


async def test_anonymous_and_failed_requests_are_limited_by_address(stack, clock):
    gateway = await stack.gateway(clock=clock, rate_limit_per_s=0.5, rate_limit_burst=2)
    async with httpx.AsyncClient(base_url=gateway) as client:
        public = [(await client.get("/api/identity/auth/login")).status_code for _ in range(2)]
        bad_token = await client.get("/api/catalog/echo", headers={"Authorization": "Bearer nope"})
        authenticated = await client.get("/api/catalog/echo", headers=stack.bearer())
    assert public == [200, 200]
    assert bad_token.status_code == 429  # the address's bucket is empty: no more guesses
    assert authenticated.status_code == 200  # a valid principal has its own bucket
