# GPUaaS control plane: developer entry points (see docs and deploy/local for `make run`).
SHELL := /bin/bash
PYTHON ?= python3
# uv on PATH, else where `pip install --user uv` puts it. Recursively expanded on purpose: a recipe
# that runs after `ensure-uv` sees the uv it just installed.
UV = $(shell command -v uv 2>/dev/null || echo $(HOME)/.local/bin/uv)
UV_RUN = $(UV) run --frozen

.PHONY: run install migrate ensure-uv deps-apt deps-apt-packages subids runtime-images infra-images test-containers images deploy-images deploy-up deploy-down deploy-test test test-unit test-isolation lint bench demo test-kafka test-faults test-badinput kafka-jars console contracts-wheel chart-check \
	observability-check

## run: install, then start Postgres, Kafka (Tansu), the OCI registry with the runtime images (built once, cached),
##      every service and the gateway, and two node agents (container driver); Ctrl-C stops all
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

# Built again only when a source changed: every target runs `install`, and CI runs two lanes at once, so a
# rebuild would rewrite dist/ under a gateway another lane's tests are serving it from.
CONSOLE_SOURCES := $(shell find $(CONSOLE)/src -type f 2>/dev/null) \
	$(wildcard $(CONSOLE)/index.html $(CONSOLE)/package.json $(CONSOLE)/tsconfig.json $(CONSOLE)/vite.config.ts)
$(CONSOLE)/dist/.built: $(CONSOLE)/node_modules/.installed $(CONSOLE_SOURCES)
	cd $(CONSOLE) && npm run --silent build
	touch $@

console: $(CONSOLE)/dist/.built

## migrate: provision the database, roles and schemas and run every service's migrations
##          (embedded Postgres under .local/pg, or GPUAAS_DATABASE_URL's server)
migrate: install
	$(UV_RUN) python -m gpuaas.devstack migrate

## test: unit, integration (real Postgres + Tansu started by the suite), e2e and bad input (every service as a
##       process); the fault-injection tests run in `make test-faults` / `make test-kafka`, the compose
##       deployment's in `make deploy-test` (tests/deploy)
##       TEST_ARGS adds pytest arguments: CI passes --ignore=tests/e2e and runs the e2e suite once, in
##       `make test-containers` (on Apache Kafka). One pytest process per group of folders
##       (scripts/pytest_groups.py); a path in TEST_ARGS runs just that, in one process
test: install
	$(UV_RUN) python scripts/pytest_groups.py --ignore=tests/faults --ignore=tests/deploy $(TEST_ARGS)

## test-unit: the fast lane (under 2 minutes): every test that starts no Postgres, broker, podman, network namespace or
##            browser. A test's lane follows from its fixtures (conftest.py: SERVER_FIXTURES marks it integration/e2e);
##            here GPUAAS_TEST_LANE=unit makes any start of such a server fail, naming the test to mark. No console build
test-unit: deps-apt ensure-uv
	GPUAAS_TEST_LANE=unit $(UV_RUN) pytest -q -p no:cacheprovider -m "not integration and not e2e" \
		--ignore=tests/faults --ignore=tests/deploy $(TEST_ARGS)

# Apache Kafka (4.x KRaft, Java 17, jars from Maven Central cached in ~/.cache/gpuaas): see gpuaas.devstack.kafka.
KAFKA_TEST_DIR ?= .local/test-kafka
KAFKA_CLI = $(UV_RUN) python -m gpuaas.devstack.kafka
# --durations: every suite names its slowest tests, so a CI log says where its minutes went.
PYTEST = $(UV_RUN) pytest -q -p no:cacheprovider --durations=15 --durations-min=15

## kafka-jars: fetch Apache Kafka's jars once (mvn dependency:copy-dependencies into the cache)
kafka-jars: install
	$(KAFKA_CLI) fetch

## keycloak: fetch the Keycloak server distribution once (mvn dependency:copy from Maven Central, unpacked into
##           ~/.cache/gpuaas/keycloak) for tests/e2e/test_keycloak_federation.py (which fetches it itself if missing)
keycloak: install
	$(UV_RUN) python -m gpuaas.devstack.keycloak fetch

## test-kafka: what proves something about the broker, on Apache Kafka: the libraries' integration tests (the kit's
##             outbox, relay, inbox consumer, dead letters, SASL/ACLs) against a fresh broker started here
##             (GPUAAS_KAFKA_BOOTSTRAP), then bad input and fault injection on stacks that each run their own Apache
##             Kafka (GPUAAS_STACK_BROKER=kafka: broker stop/start keeps the log). The services' and agents' suites use
##             the broker only through the kit and run once, on Tansu, in `make test`; the e2e suite runs on Apache
##             Kafka in `make test-containers`. CI leaves tests/badinput out of `make test` (it runs here)
test-kafka: kafka-jars
	@set -euo pipefail; \
	$(KAFKA_CLI) stop --dir $(KAFKA_TEST_DIR) --remove; \
	bootstrap=$$($(KAFKA_CLI) start --dir $(KAFKA_TEST_DIR) --fresh); \
	trap '$(KAFKA_CLI) stop --dir $(KAFKA_TEST_DIR) --remove' EXIT; \
	echo "integration suites on Apache Kafka at $$bootstrap"; \
	GPUAAS_KAFKA_BOOTSTRAP=$$bootstrap $(UV_RUN) python scripts/pytest_groups.py --group=libs
	GPUAAS_STACK_BROKER=kafka $(PYTEST) tests/badinput
	GPUAAS_STACK_BROKER=kafka $(PYTEST) tests/faults

## infra-images: the Apache Kafka and Postgres images of the compose deployment and of make test-containers
##               (localhost/gpuaas-kafka:<version>, localhost/gpuaas-postgres:15; deploy/images/infra): Debian 12 bases
##               with mmdebstrap, then podman build; cached (a second run checks labels only); prints their sizes
infra-images: kafka-jars
	$(UV_RUN) python -m gpuaas.devstack.infra_images build

## test-containers: the e2e suite with Postgres and Apache Kafka from testcontainers (the infra images, through
##                  podman's Docker-compatible API that the fixtures start: GPUAAS_STACK_BROKER=testcontainers;
##                  broker stop/start is podman stop/start of the Kafka container, which keeps the log);
##                  E2E_ARGS adds pytest arguments (CI leaves the golden path to the compose deployment's deploy-test,
##                  which runs the same scenario, gpuaas.devstack.golden_path, through two replicas of everything)
test-containers: infra-images
	GPUAAS_STACK_BROKER=testcontainers $(PYTEST) $(E2E_ARGS) tests/e2e

## images: the platform image localhost/gpuaas-platform:<version> (every service, the gateway with the web console,
##         the node agent, the migrate/enrol jobs; deploy/images/services) and its Debian 12 bases (mmdebstrap,
##         cached by recipe hash), built with podman (layer cache: a second run takes seconds); prints each size
images: install
	$(UV_RUN) python deploy/images/services/build.py

# The images deploy-up needs, built only when missing (make images / make infra-images rebuild on purpose).
PODMAN = CONTAINERS_CONF=$(CURDIR)/deploy/local/containers.conf podman
deploy-images: install
	@$(PODMAN) image exists localhost/gpuaas-platform:latest && $(PODMAN) image exists localhost/gpuaas-nginx:1.22-bookworm \
		|| $(MAKE) images
	@$(PODMAN) image exists localhost/gpuaas-kafka:4.1.0 && $(PODMAN) image exists localhost/gpuaas-postgres:15 \
		|| $(MAKE) infra-images

## deploy-up: the compose deployment (deploy/compose: Postgres, 3 Kafka brokers, two replicas of every service and
##            of the gateway, lb, one node agent) with podman-compose: images if missing, secrets once, started in
##            phases (migrate job first), waits until every replica is ready; prints the time from up to ready.
##            Gateway on http://127.0.0.1:18000 (deploy/compose/README.md)
deploy-up: deploy-images
	$(UV_RUN) python deploy/compose/deploy.py up

## deploy-down: remove the compose deployment: containers, network, volumes (the secrets in .local/compose stay)
deploy-down: ensure-uv
	$(UV_RUN) python deploy/compose/deploy.py down

## deploy-test: tests/deploy against the compose deployment (started first when it is not running and ready)
deploy-test: deploy-images
	@GPUAAS_DEPLOY_READY_TIMEOUT_S=5 $(UV_RUN) python deploy/compose/deploy.py wait 2>/dev/null \
		|| $(UV_RUN) python deploy/compose/deploy.py up
	GPUAAS_DEPLOY_URL=http://127.0.0.1:$${GPUAAS_DEPLOY_PORT:-18000} $(PYTEST) --timeout 1800 tests/deploy

## test-faults: fault injection only (SIGKILLs, broker stop/crash/outage, Postgres restart, node-agent kill) on Apache Kafka
test-faults: kafka-jars
	GPUAAS_STACK_BROKER=kafka $(PYTEST) -s tests/faults

## test-isolation: isolated allocations through the platform (tests/isolation: two tenants on one container host,
##                 limits, release, agent SIGKILLs, tampered and retired runtimes; real podman, registry and SSH, as
##                 root); `make test` collects them too
test-isolation: install
	$(PYTEST) tests/isolation

## test-badinput: schemathesis through the gateway and direct, oversized bodies, malformed events (Tansu)
test-badinput: install
	$(PYTEST) -s tests/badinput

## lint: ruff (lint + format check), import-linter (no service imports another) and the type checker
##       (basedpyright: strict on libs, the node agent and the CLI, standard elsewhere; [tool.basedpyright])
lint: install
	$(UV_RUN) ruff check .
	$(UV_RUN) ruff format --check .
	$(UV_RUN) lint-imports
	$(UV_RUN) basedpyright

## observability-check: alert rules (promtool check + unit tests), scrape configs and Grafana dashboards
##                      (JSON, PromQL, metric names) of deploy/observability, and the metric naming rules
OBS := deploy/observability
observability-check: install
	promtool check rules $(OBS)/prometheus/alerts.yml
	promtool test rules $(OBS)/prometheus/tests/alerts_test.yml
	promtool check config $(OBS)/prometheus/prometheus.yml $(OBS)/prometheus/prometheus-local.yml
	$(PYTEST) $(OBS)/tests libs/kit/tests/test_metrics_names.py

## runtime-images: build the runtime images allocations run in (gpuaas-base, gpuaas-scipy: Debian 12 with mmdebstrap,
##                 recipes in deploy/images/runtimes) into podman's storage; cached by recipe hash in
##                 ~/.cache/gpuaas/runtime-images (`make run` pushes them to its registry and seeds the catalog)
runtime-images: install
	$(UV_RUN) python -m gpuaas.devstack.runtime_images build

## demo: the golden path (tenant → allocations → Slurm → billing → audit) against a running `make run`, step by step
demo: install
	$(UV_RUN) python scripts/demo.py

## contracts-wheel: the standalone gpuaas-contracts wheel in dist/contracts (pydantic only; its JSON Schemas and
##                  AsyncAPI document inside), installed in fresh virtualenvs without the platform and checked
##                  (import, an event validated, packaged schemas == code; the [faststream] extra imports)
contracts-wheel: install
	$(UV_RUN) python scripts/contracts_wheel.py

## chart-check: render deploy/helm/gpuaas with the real helm for every value set in its ci/ folder and validate
##              every object offline against the Kubernetes $(KUBE_VERSION) schemas (and the ServiceMonitor against
##              the Prometheus Operator CRD); helm is built once with Go into ~/.cache/gpuaas (scripts/chart_check.py)
HELM_VERSION := v3.22.0
HELM := $(HOME)/.cache/gpuaas/helm-$(HELM_VERSION)/helm
PROMETHEUS_OPERATOR := github.com/prometheus-operator/prometheus-operator@v0.85.0
KUBE_VERSION ?= 1.33.0
$(HELM):
	@command -v go >/dev/null || { echo "Go is needed to build helm (go install helm.sh/helm/v3/cmd/helm)" >&2; exit 1; }
	GOBIN=$(dir $(HELM)) go install helm.sh/helm/v3/cmd/helm@$(HELM_VERSION)

chart-check: ensure-uv $(HELM)
	@set -euo pipefail; \
	module=$$(cd / && GOWORK=off go mod download -json $(PROMETHEUS_OPERATOR) | sed -n 's/^\t"Dir": "\(.*\)",$$/\1/p'); \
	$(UV_RUN) python scripts/chart_check.py --helm $(HELM) --kube-version $(KUBE_VERSION) \
		--crds "$$module/example/prometheus-operator-crd"

## bench: every benchmark, one after the other (each prints its figures and writes bench/results/<name>.json;
##        see bench/README.md): event pipeline, FastStream consumer, metering, allocations, gateway vs nginx, load
BENCHES := event_pipeline faststream_consumer metering allocations gateway load revocation capacity overlay
bench: install
	@set -e; for b in $(BENCHES); do echo "== bench/$$b.py"; $(UV_RUN) python bench/$$b.py; done

# Debian packages used by the tests: the OCI registry and image tools (catalog trust), Chromium (console
# browser tests), Slurm 22.05 + munge + slurmdbd on MariaDB + PMIx (the Slurm reference controller). Java 17
# and Maven (Apache Kafka for make test-kafka / test-faults) come with the machine image. prometheus: promtool for
# make observability-check, and the server tests/e2e/test_business_metrics.py scrapes the stack with. nginx-light:
# the standard proxy bench/gateway.py measures the gateway against (the bench runs its own nginx from a config it
# writes; the package's own service, if the install started one, is not used). podman, runc, slirp4netns, uidmap:
# the node agent's container driver (deploy/local/containers.conf); mmdebstrap builds the runtime images.
# podman-compose + the CNI dnsname plugin (container names resolve on the compose network): make deploy-up.
APT_PACKAGES := docker-registry skopeo umoci chromium slurm-wlm slurmdbd munge mariadb-server libpmix-dev prometheus \
	nginx-light podman runc slirp4netns mmdebstrap uidmap podman-compose golang-github-containernetworking-plugin-dnsname
deps-apt: subids
subids: deps-apt-packages
	@# podman's --userns=auto takes container user namespaces from the `containers` ranges (idempotent)
	@sudo=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
	for f in /etc/subuid /etc/subgid; do \
		grep -q '^containers:' $$f 2>/dev/null || echo 'containers:2147483647:2147483648' | $$sudo tee -a $$f >/dev/null; \
	done
deps-apt-packages:
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
