# The two commands of the README: `make demo` and `make test`. Everything else is a step of theirs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CLIENT_SPEEDUPS := build/.client-speedups
CORRELATOR_KERNELS := build/.correlator-kernels
C_PARTS := $(CLIENT_SPEEDUPS) $(CORRELATOR_KERNELS)
STAGE := build/dist
DIST := dist

# Each distribution is built from a folder of its own (an sdist holds only what lies under its project):
# the client's metadata (clients/python) beside stallwatch/client, and the agent's beside the rest.
define stage
	rm -rf $(STAGE) && mkdir -p $(STAGE)/client $(STAGE)/agent
	cp clients/python/pyproject.toml clients/python/setup.py clients/python/README.md $(STAGE)/client/
	tar -c --exclude=__pycache__ --exclude='*.so' stallwatch/client | tar -x -C $(STAGE)/client
	tar -c --exclude=__pycache__ --exclude='*.so' --exclude=stallwatch/client --exclude=stallwatch/_revision \
	  pyproject.toml setup.py README.md stallwatch | tar -x -C $(STAGE)/agent
	git rev-parse HEAD > $(STAGE)/agent/stallwatch/_revision 2>/dev/null || true
endef

.PHONY: test check demo dist generate lint typecheck pytest system-deps helm-tools benchmarks image protos clean

test: $(STAMP) system-deps helm-tools lint typecheck pytest

# The quick tier: lint, types, and every test that starts no real process (the others skip themselves when
# they try: tests/conftest.py), on every core.
check: $(STAMP) $(C_PARTS) lint typecheck
	$(PY) -m pytest -q --no-processes -n auto

demo: $(STAMP) system-deps $(C_PARTS)
	$(PY) -m stallwatch demo $(DEMO_ARGS)

$(STAMP): pyproject.toml clients/python/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# What the client tests run on: the CPU wheel of torch 2.13.0 (any other version would pull a
	# multi-GB CUDA build). The client itself pins no torch.
	$(PY) -m pip install -q torch==2.13.0
	$(stage)
	# The agent needs the client's distribution: pip installs the staged copy, which is never imported.
	# The compat editable install puts the checkout on the path, and its regular package `stallwatch`
	# (with stallwatch/client) wins over the namespace portion the copy lays in site-packages.
	$(PY) -m pip install -q $(STAGE)/client -e '.[test,report]' --config-settings editable_mode=compat
	touch $@

# The client's C parts (clients/python/setup.py), built into the checkout that the dev install
# puts on the path; optional: without a C compiler the client runs their Python twins.
$(CLIENT_SPEEDUPS): stallwatch/client/_speedups.c clients/python/setup.py | $(STAMP)
	$(PY) clients/python/setup.py -q build_ext --inplace --build-temp build/client-speedups
	mkdir -p $(@D) && touch $@

# The correlator's C kernels (setup.py), likewise optional: without them it runs their NumPy versions.
$(CORRELATOR_KERNELS): stallwatch/correlator/_kernels.c setup.py | $(STAMP)
	$(PY) setup.py -q build_ext --inplace --build-temp build/correlator-kernels
	mkdir -p $(@D) && touch $@

# The two distributions into dist/, built offline: stallwatch-client (stallwatch/client), an sdist, a wheel
# with the C parts for this platform and one without them for any, and stallwatch (the rest, with the revision
# it was built from: stallwatch/build.py), likewise an sdist, a wheel with the correlator's C kernels and one
# without them.
dist: $(STAMP)
	$(stage)
	rm -rf $(DIST)
	$(PY) -m build -q --no-isolation --outdir $(DIST) $(STAGE)/client
	STALLWATCH_CLIENT_PURE=1 $(PY) -m build -q --no-isolation --wheel --outdir $(DIST) $(STAGE)/client
	$(PY) -m build -q --no-isolation --outdir $(DIST) $(STAGE)/agent
	STALLWATCH_AGENT_PURE=1 $(PY) -m build -q --no-isolation --wheel --outdir $(DIST) $(STAGE)/agent

system-deps:
	PYTHON=$(PYTHON) scripts/install-system-deps.sh

# helm and kubectl for the chart's tests, into build/tools/bin.
helm-tools:
	scripts/install-helm.sh

lint: $(STAMP)
	$(PY) -m ruff check .

typecheck: $(STAMP)
	$(PY) -m mypy

pytest: $(STAMP) system-deps helm-tools $(C_PARTS)
	$(PY) -m pytest -q

generate: $(STAMP)
	$(PY) -m stallwatch generate

# The agent's image (Containerfile) with buildah; IMAGE=... names it, BASE=... builds from a registry image.
image: $(STAMP) system-deps
	PYTHON=$(PY) scripts/build-image.sh $(IMAGE)

# The kubelet pod-resources modules from stallwatch/exporters/kubelet/api.proto (a test fails when stale).
protos: $(STAMP)
	PYTHON=$(PY) scripts/generate-protos.sh

benchmarks: $(STAMP) $(C_PARTS)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
