# Two commands: `make demo` and `make test`. Both bootstrap .venv on first use.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch first and pinned: a looser spec can pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.stamp-$(shell cat pyproject.toml | sha256sum | cut -c1-16)-$(shell echo '$(TORCH_SPEC)' | sha256sum | cut -c1-8)

.PHONY: venv test lint typecheck protos protos-check demo bench soak clean

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

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

PACKAGES := client rpc registry trainer_server sampler_server gateway
typecheck: $(STAMP)
	@mkdir -p build/typecheck/opentinker
	@for p in $(PACKAGES); do ln -sfn ../../../$$p build/typecheck/opentinker/$$p; done
	@ln -sfn ../../../protos/opentinker/v1 build/typecheck/opentinker/v1
	$(BIN)/mypy $(addprefix -p opentinker.,$(PACKAGES))
	@# tests and bench: plain files with unique basenames; untyped fixtures tolerated
	$(BIN)/mypy --no-explicit-package-bases --allow-untyped-defs --allow-incomplete-defs $$(find tests bench -name '*.py')

test: $(STAMP) lint typecheck
	$(BIN)/python -m pytest tests

demo: $(STAMP)
	$(BIN)/opentinker demo

# Benchmarks print ratios measured side by side in one run; QUICK=1 for a short run.
bench: $(STAMP)
	$(BIN)/python bench/trainer_overhead.py $(if $(QUICK),--quick)
	$(BIN)/python bench/sampler_multilora.py $(if $(QUICK),--quick)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
