"""gpuaas.devstack: the local stack behind `make run` and the test fixtures (embedded Postgres, Tansu,
every service as a real process)."""
