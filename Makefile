# GPUaaS control plane: developer entry points (see docs and deploy/local for `make run`).
SHELL := /bin/bash
PYTHON ?= python3
# uv on PATH, else where `pip install --user uv` puts it. Recursively expanded on purpose: a recipe
# that runs after `ensure-uv` sees the uv it just installed.
UV = $(shell command -v uv 2>/dev/null || echo $(HOME)/.local/bin/uv)
UV_RUN = $(UV) run --frozen

.PHONY: run install migrate ensure-uv deps-apt test test-unit lint bench console

## run: install, then start Postgres, Kafka (Tansu), every service and the gateway; Ctrl-C stops all
run: install
	$(UV_RUN) python -m gpuaas.devstack run

## install: Debian packages the tests use (if missing), uv (if missing), the locked workspace environment
##          and the web console build (served by the gateway at /)
install: deps-apt ensure-uv console
	$(UV) sync --frozen

## console: the web console (web/console, Vite + TypeScript): npm ci from package-lock.json, then build into dist/
CONSOLE := web/console
$(CONSOLE)/node_modules/.installed: $(CONSOLE)/package-lock.json
	@command -v npm >/dev/null || { echo "node and npm are needed to build the web console" >&2; exit 1; }
	cd $(CONSOLE) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

console: $(CONSOLE)/node_modules/.installed
	cd $(CONSOLE) && npm run --silent build

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

# Debian packages used by the tests: the OCI registry and image tools for catalog trust; Chromium for the
# web console's browser test (driven by playwright-core from web/console's node_modules).
APT_PACKAGES := docker-registry skopeo umoci chromium
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
