# GPUaaS control plane: developer entry points (see docs and deploy/local for `make run`).
SHELL := /bin/bash
PYTHON ?= python3
# uv on PATH, else where `pip install --user uv` puts it. Recursively expanded on purpose: a recipe
# that runs after `ensure-uv` sees the uv it just installed.
UV = $(shell command -v uv 2>/dev/null || echo $(HOME)/.local/bin/uv)
UV_RUN = $(UV) run --frozen

.PHONY: run install migrate ensure-uv deps-apt test test-unit lint bench

## run: install, then start Postgres, Kafka (Tansu), every service and the gateway; Ctrl-C stops all
run: install
	$(UV_RUN) python -m gpuaas.devstack run

## install: Debian packages the tests use (if missing), uv (if missing) and the locked workspace environment
install: deps-apt ensure-uv
	$(UV) sync --frozen

## migrate: provision the database, roles and schemas and run every service's migrations
##          (embedded Postgres under .local/pg, or GPUAAS_DATABASE_URL's server)
migrate: install
	$(UV_RUN) python -m gpuaas.devstack migrate

## test: unit, integration (real Postgres + Tansu started by the suite) and e2e (every service as a process)
test: install
	$(UV_RUN) pytest -q -p no:cacheprovider

## lint: ruff (lint + format check) and import-linter (no service imports another)
lint: install
	$(UV_RUN) ruff check .
	$(UV_RUN) ruff format --check .
	$(UV_RUN) lint-imports

## bench: the event pipeline benchmark (prints figures; see bench/)
bench: install
	$(UV_RUN) python bench/event_pipeline.py

# Debian packages used by the tests: the OCI registry and image tools for catalog trust.
APT_PACKAGES := docker-registry skopeo umoci
deps-apt:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages:" $$missing; \
		sudo=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
		$$sudo apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq --no-install-recommends $$missing; \
	fi

ensure-uv:
	@if ! command -v uv >/dev/null 2>&1 && [ ! -x "$(HOME)/.local/bin/uv" ]; then \
		echo "uv not found: installing it with pip"; \
		$(PYTHON) -m pip install --user uv || $(PYTHON) -m pip install uv; \
	fi
	@command -v uv >/dev/null 2>&1 || [ -x "$(HOME)/.local/bin/uv" ] || { \
		echo "uv is still not on PATH or in ~/.local/bin; see https://docs.astral.sh/uv/getting-started/installation/" >&2; \
		exit 1; }
