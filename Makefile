# Two commands: `make demo` and `make test`. Both bootstrap .venv on first use.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch first and pinned: a looser spec can pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.stamp-$(shell cat pyproject.toml | sha256sum | cut -c1-16)-$(shell echo '$(TORCH_SPEC)' | sha256sum | cut -c1-8)

.PHONY: venv azurite haproxy test lint typecheck imports linktree protos protos-check go-check demo bench bench-check soak clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	@rm -f $(VENV)/.stamp-*
	@touch $@

protos: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos \
		--grpc_python_out=protos protos/opentinker/v1/*.proto

# buf lint + buf breaking against main (PROTOS_BASE=...; protos/buf-check.sh says how it finds the base).
protos-check: $(STAMP)
	BUF=$(BIN)/buf protos/buf-check.sh

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

PACKAGES := client rpc weights registry trainer_server sampler_server gateway cli
# mypy and import-linter cannot follow setuptools' package-dir: a link tree build/typecheck/opentinker/<pkg>.
linktree:
	@mkdir -p build/typecheck/opentinker
	@for p in $(PACKAGES); do ln -sfn ../../../$$p build/typecheck/opentinker/$$p; done
	@ln -sfn ../../../protos/opentinker/v1 build/typecheck/opentinker/v1

typecheck: $(STAMP) linktree
	$(BIN)/mypy $(addprefix -p opentinker.,$(PACKAGES))
	@# tests and bench: plain files with unique basenames; untyped fixtures tolerated
	$(BIN)/mypy --no-explicit-package-bases --allow-untyped-defs --allow-incomplete-defs \
		$$(find tests bench -name '*.py' ! -path 'tests/*/conftest.py')
	@# conftest.py files in subfolders all map to the module name "conftest": one run each
	@for f in $$(find tests -mindepth 2 -name conftest.py); do \
		$(BIN)/mypy --no-explicit-package-bases --allow-untyped-defs --allow-incomplete-defs $$f || exit 1; done

# The import rule of docs/architecture.md ([tool.importlinter] in pyproject.toml).
imports: $(STAMP) linktree
	cd build/typecheck && PYTHONPATH=. ../../$(BIN)/lint-imports ../../pyproject.toml --no-cache

# Azurite (Azure Blob's emulator, for the object-store tests) from npm into a project-local folder.
AZURITE_VERSION := 3.37.0
AZURITE_STAMP := build/azurite/.stamp-$(AZURITE_VERSION)
azurite: $(AZURITE_STAMP)
$(AZURITE_STAMP):
	@command -v npm >/dev/null || { echo "make azurite: npm is missing (apt-get install npm): the Azure Blob tests need it" >&2; exit 1; }
	npm install --silent --no-audit --no-fund --prefix build/azurite azurite@$(AZURITE_VERSION)
	@touch $@

# Debian's haproxy, for the test of deploy/haproxy in front of a sampler fleet; installed only where absent.
haproxy:
	@deploy/haproxy/install.sh

# Test modules run TEST_WORKERS-way parallel (pytest-xdist); a module's tests stay on one worker, in order,
# sharing its server fixtures. TEST_WORKERS=0 runs them all in this process.
TEST_WORKERS ?= 2
test: $(STAMP) azurite haproxy lint typecheck imports protos-check
	@# The slowest 15 tests close every run, so growth is visible.
	$(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist loadfile --durations=15

demo: $(STAMP)
	$(BIN)/opentinker demo

# The Go client example (examples/go) against real servers; installs Debian's Go packages if missing.
go-check: $(STAMP)
	examples/go/install-deps.sh
	examples/go/build.sh
	$(BIN)/python examples/go/run_example.py

# Benchmarks print ratios measured side by side in one run, write bench/results.json and print the table of all
# figures; QUICK=1 for a short run (small model).
bench: $(STAMP)
	$(BIN)/python bench/run_all.py $(if $(QUICK),--quick)

# Before landing a change to the engine, the kernels or the model code: the quick P1, P2a and P3 of this tree
# against the build before it (BASE=<git ref> to choose), alternating in one run; fails when a ratio drops > 5%.
bench-check: $(STAMP)
	$(BIN)/python bench/bench_check.py $(if $(BASE),--base $(BASE))

# The reliability suite with its load test at 60 s instead of 10 s, and the HTTP fuzzer at 500 examples per route.
soak: $(STAMP)
	OPENTINKER_SOAK=1 $(BIN)/python -m pytest tests/reliability -q
	OPENTINKER_FUZZ_EXAMPLES=500 $(BIN)/python -m pytest tests/gateway/test_http_fuzz.py -q

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
