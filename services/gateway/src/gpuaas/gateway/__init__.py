"""gpuaas-gateway: the one public origin.

`/api/<service>/...` proxied to the services (HTTP streamed both ways, SSE, WebSocket), JWT checked
at the edge, correlation id, per-principal rate limit, aggregated OpenAPI at `/openapi.json` and
`/docs`, and `/healthz`, `/readyz`, `/metrics`. Run with `python -m gpuaas.gateway serve`.
"""

SERVICE = "gateway"
