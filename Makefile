# GPUaaS control plane: developer entry points (see docs and deploy/local for `make run`).
SHELL := /bin/bash
PYTHON ?= python3
# uv on PATH, else where `pip install --user uv` puts it. Recursively expanded on purpose: a recipe
# that runs after `ensure-uv` sees the uv it just installed.
UV = $(shell command -v uv 2>/dev/null || echo $(HOME)/.local/bin/uv)
UV_RUN = $(UV) run --frozen

.PHONY: run install migrate ensure-uv

## run: install, then start Postgres, Kafka (Tansu), every service and the gateway; Ctrl-C stops all
run: install
	$(UV_RUN) python -m gpuaas.devstack run

## install: uv (if missing) and the locked workspace environment
install: ensure-uv
	$(UV) sync --frozen

## migrate: provision the database, roles and schemas and run every service's migrations
##          (embedded Postgres under .local/pg, or GPUAAS_DATABASE_URL's server)
migrate: install
	$(UV_RUN) python -m gpuaas.devstack migrate

# test, test-kafka, lint: added with the test suites.

ensure-uv:
	@if ! command -v uv >/dev/null 2>&1 && [ ! -x "$(HOME)/.local/bin/uv" ]; then \
		echo "uv not found: installing it with pip"; \
		$(PYTHON) -m pip install --user uv || $(PYTHON) -m pip install uv; \
	fi
	@command -v uv >/dev/null 2>&1 || [ -x "$(HOME)/.local/bin/uv" ] || { \
		echo "uv is still not on PATH or in ~/.local/bin; see https://docs.astral.sh/uv/getting-started/installation/" >&2; \
		exit 1; }
