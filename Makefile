# Two entry points do all their own set-up on a fresh Debian machine:
#   make run   the main job      make test   lint, types and the test suite
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: run test lint typecheck pytest protos bench bench-deps bench-peers chaos sysdeps venv clean

# System packages: etcd is the metadata store (tests start their own etcd processes);
# Java 17 runs Spark.
sysdeps:
	@if ! command -v etcd >/dev/null 2>&1 && [ ! -x /usr/bin/etcd ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing etcd-server with apt"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null; \
	  else echo "etcd is missing: run 'sudo apt-get install -y etcd-server'" >&2; fi; \
	fi
	@# kubectl renders the Kubernetes manifests in tests/test_deploy.py.
	@if ! command -v kubectl >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing kubectl with apt"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubectl >/dev/null \
	      || echo "kubectl is not in the configured apt sources; tests/test_deploy.py skips rendering the manifests" >&2; \
	  else echo "kubectl is missing: install it (apt-get install -y kubectl)" >&2; fi; \
	fi
	@# strace injects disk errors and ip makes network namespaces (tests/chaos).
	@if ! command -v strace >/dev/null 2>&1 || ! command -v ip >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing strace and iproute2 with apt"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq strace iproute2 >/dev/null; \
	  else echo "strace/ip missing: the chaos tests will skip disk errors and partitions" >&2; fi; \
	fi
	@# Java runs Spark (the pipeline and the data source tests).
	@if ! command -v java >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing a Java runtime with apt (openjdk-17, else the release's default)"; \
	    apt-get update -qq && { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless >/dev/null 2>&1 \
	      || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq default-jre-headless >/dev/null; }; \
	  else echo "java is missing: run 'sudo apt-get install -y default-jre-headless'" >&2; fi; \
	fi

$(STAMP): pyproject.toml
	@# Debian keeps ensurepip (which `python3 -m venv` needs) in python3-venv, which a
	@# fresh install lacks. A venv whose creation failed has bin/python but no pip: made
	@# again (--clear), or every later make failed on the missing pip.
	@if ! $(PY) -m ensurepip --version >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing python3-venv with apt"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null; \
	  else echo "$(PY) cannot make a virtualenv: run 'sudo apt-get install -y python3-venv'" >&2; exit 1; fi; \
	fi
	@test -x $(BIN)/pip || $(PY) -m venv --clear $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@touch $(STAMP)

venv: $(STAMP)

# The nginx access-log pipeline on Spark against a local cluster (examples/nginx_pipeline).
run: sysdeps venv
	$(BIN)/python -m examples.nginx_pipeline

lint: venv
	$(BIN)/ruff check tidelog services tests bench examples pyspark_tidelog
	$(BIN)/ruff format --check tidelog services tests bench examples pyspark_tidelog

typecheck: venv
	$(BIN)/mypy

# Two workers, whole modules each (module-scoped clusters stay in one process): the suite
# mostly waits on real processes and timeouts, so two halve its time on 2 cores. A test
# that fails is run once more and reported as a rerun in the summary: on a loaded 2-core
# machine a few failover tests with 2 s leases can lose a race to the scheduler; a real
# failure fails twice.
PYTEST_WORKERS ?= 2

pytest: venv
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadfile --reruns 1 --durations=15 -m "not slow" tests

test: sysdeps venv lint typecheck pytest

protos: venv
	$(BIN)/python -m tidelog.protogen

bench: venv
	$(BIN)/python -m bench.storage_engine --write-docs

# The peers tidelog is compared with (bench/suite.py): Debian's servers, PyPI's clients.
bench-deps: venv
	@if ! command -v nats-server >/dev/null 2>&1 || ! command -v redis-server >/dev/null 2>&1; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nats-server redis-server >/dev/null; \
	fi
	$(BIN)/pip install -q -e '.[dev,bench]'

bench-peers: sysdeps bench-deps
	PYTHONPATH=. $(BIN)/tidelog bench --write-docs

# The long reliability run (docs/RELIABILITY.md): thousands of simulation seeds, hundreds
# of hostile examples per RPC, then many chaos seeds with several rounds of every fault
# each, whose figures go into the docs. Needs root for network namespaces
# and strace for disk errors (sysdeps installs them when missing).
chaos: sysdeps venv
	TIDELOG_SIM_SEEDS=5000 $(BIN)/pytest -q tests/sim
	$(BIN)/pytest -q -m slow tests
	TIDELOG_FUZZ_EXAMPLES=300 $(BIN)/pytest -q tests/test_hostile_input.py
	TIDELOG_CRASH_IMAGE_SEEDS=200 $(BIN)/pytest -q tests/test_crash_images.py
	PYTHONPATH=. $(BIN)/python -m tests.chaos --seeds 1-16 --rounds 3 --negative-seeds 1-2 --write-docs
	PYTHONPATH=. $(BIN)/python -m tests.chaos.groups --seeds 1-3 --seconds 120 --mode both

clean:
	rm -rf $(VENV) build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache
