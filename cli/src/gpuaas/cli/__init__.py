"""`gpuaas`: the platform's command line (typer + rich) on top of gpuaas.sdk."""
