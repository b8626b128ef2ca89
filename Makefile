# The two commands of the README: `make demo` and `make test`. Everything else is a step of theirs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo generate lint typecheck pytest system-deps helm-tools benchmarks image protos clean

test: $(STAMP) system-deps helm-tools lint typecheck pytest

demo: $(STAMP) system-deps
	$(PY) -m stallwatch demo $(DEMO_ARGS)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch 2.13.0: any other version would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,torch,report]'
	touch $@

system-deps:
	scripts/install-system-deps.sh

# helm and kubectl for the chart's tests, into build/tools/bin.
helm-tools:
	scripts/install-helm.sh

lint: $(STAMP)
	$(PY) -m ruff check .

typecheck: $(STAMP)
	$(PY) -m mypy

pytest: $(STAMP) system-deps helm-tools
	$(PY) -m pytest -q

generate: $(STAMP)
	$(PY) -m stallwatch generate

# The agent's image (Containerfile) with buildah; IMAGE=... names it, BASE=... builds from a registry image.
image: $(STAMP) system-deps
	PYTHON=$(PY) scripts/build-image.sh $(IMAGE)

# The kubelet pod-resources modules from stallwatch/exporters/kubelet/api.proto (a test fails when stale).
protos: $(STAMP)
	PYTHON=$(PY) scripts/generate-protos.sh

benchmarks: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
