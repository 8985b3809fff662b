"""The `gpuaas` commands, one module per area; `gpuaas.cli.main` assembles them into one typer app."""
